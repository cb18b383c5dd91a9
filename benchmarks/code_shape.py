"""The code's shape in numbers, for the redesign's before/after (issue 32): long functions, large classes, config
fields copied by hand, whole Trainers built by tests, import cycles through lazy imports.

    .venv/bin/python benchmarks/code_shape.py            # a table on stdout
    .venv/bin/python benchmarks/code_shape.py --json     # the same figures as JSON

- **long functions / large classes**: source lines (first to last line of the definition, decorators and
  docstring included) of every function over ``--function-lines`` and class over ``--class-lines`` in ``ctxrl/``;
- **fields copied by hand**: keyword arguments of the form ``name=<something>.name`` (``lr=c.lr``,
  ``max_turns=config.env.max_turns``) in a function that reads a config, or through a ``config`` name: a config
  field handed on one keyword at a time (a heuristic: it counts call sites, not distinct fields);
- **config fields**: fields of the dataclasses in ``ctxrl/config.py``;
- **Trainer constructions in tests**: calls of ``Trainer(...)`` in ``tests/``, and the test files with any;
- **lazy import cycles**: groups of modules that reach each other through imports anywhere in a file
  (top-level cycles are a test failure: ``tests/test_import_layers.py``).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def definitions(root: Path, kind: type, minimum: int) -> list[tuple[int, str]]:
    """(lines, "file:Qualified.name") of every ``kind`` definition longer than ``minimum`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())

        def walk(node: ast.AST, prefix: str, path: Path = path) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    lines = child.end_lineno - first + 1
                    if isinstance(child, kind) and lines > minimum:
                        found.append((lines, f"{path.relative_to(root.parent)}:{name}"))
                    walk(child, f"{name}.")
                else:
                    walk(child, prefix)

        walk(tree, "")
    return sorted(found, reverse=True)


def copied_fields(root: Path) -> list[str]:
    """``file:line name`` of every keyword argument ``name=<expr>.name`` that hands on a config field: in a function
    whose name says it reads a config (``from_config``, ``*settings*``, ``*config*``), or whose value's attribute
    chain passes through a name containing ``config``."""
    found = []

    def chain(node: ast.AST) -> list[str]:
        names = []
        while isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        return [*names, node.id] if isinstance(node, ast.Name) else names

    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            reads_config = any(word in fn.name for word in ("from_config", "settings", "config"))
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    for kw in node.keywords:
                        if kw.arg and isinstance(kw.value, ast.Attribute) and kw.value.attr == kw.arg and (
                                reads_config or any("config" in n for n in chain(kw.value))):
                            found.append(f"{path.relative_to(root.parent)}:{kw.value.lineno} {kw.arg}")
    return sorted(set(found))


def config_fields(path: Path) -> int:
    count = 0
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Name) and d.id == "dataclass" or
                isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass" for d in node.decorator_list):
            count += sum(isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(s.annotation)
                         for s in node.body)  # (a ClassVar is no field)
    return count


def trainer_constructions(tests: Path) -> tuple[int, int]:
    calls, files = 0, 0
    for path in sorted(tests.rglob("test_*.py")):
        n = sum(isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Trainer"
                for node in ast.walk(ast.parse(path.read_text())))
        calls += n
        files += n > 0
    return calls, files


def lazy_cycles() -> list[list[str]]:
    """Strongly connected groups of modules (more than one) through every import in a file."""
    from test_import_layers import module_graph

    graph = module_graph(runtime_only=True)  # (imports under `if TYPE_CHECKING:` never run)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(groups, key=len, reverse=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--function-lines", type=int, default=60)
    parser.add_argument("--class-lines", type=int, default=250)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    functions = definitions(REPO / "ctxrl", (ast.FunctionDef, ast.AsyncFunctionDef), args.function_lines)
    classes = definitions(REPO / "ctxrl", ast.ClassDef, args.class_lines)
    copied = copied_fields(REPO / "ctxrl")
    calls, files = trainer_constructions(REPO / "tests")
    cycles = lazy_cycles()
    figures = {"functions_over_limit": len(functions), "longest_functions": functions[:10],
               "classes_over_limit": len(classes), "largest_classes": classes[:10],
               "fields_copied_by_hand": len(copied), "config_fields": config_fields(REPO / "ctxrl" / "config.py"),
               "trainer_constructions_in_tests": calls, "test_files_building_a_trainer": files,
               "lazy_import_cycles": [len(c) for c in cycles], "largest_lazy_cycle": cycles[0] if cycles else []}
    if args.json:
        print(json.dumps(figures, indent=1))
        return figures
    print(f"functions over {args.function_lines} lines: {len(functions)}")
    for lines, name in functions[:10]:
        print(f"  {lines:4d}  {name}")
    print(f"classes over {args.class_lines} lines: {len(classes)}")
    for lines, name in classes[:10]:
        print(f"  {lines:4d}  {name}")
    print(f"config fields: {figures['config_fields']}; keyword arguments copying a field by hand (name=x.name): "
          f"{len(copied)}")
    print(f"Trainer(...) constructions in tests: {calls} in {files} files")
    print(f"import cycles through lazy imports: {len(cycles)} (modules in each: {[len(c) for c in cycles]})")
    return figures


if __name__ == "__main__":
    main()
