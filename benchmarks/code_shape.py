"""The code's shape in numbers, for the redesigns' before/after (issues 32 and 50): long functions, large classes,
config fields copied by hand, whole Trainers built by tests, what constructing a config imports, import cycles.

    .venv/bin/python benchmarks/code_shape.py                          # a table on stdout
    .venv/bin/python benchmarks/code_shape.py --json > before.json     # the same figures as JSON
    .venv/bin/python benchmarks/code_shape.py --compare before.json    # each figure, before -> now

- **long functions / large classes**: source lines (first to last line of the definition, decorators and
  docstring included) of every function over ``--function-lines`` and class over ``--class-lines`` in ``ctxrl/``;
- **fields copied by hand**: keyword arguments of the form ``name=<something>.name`` (``lr=c.lr``,
  ``max_turns=config.env.max_turns``) in a function that reads a config, or through a ``config`` name: a config
  field handed on one keyword at a time (a heuristic: it counts call sites, not distinct fields; ``config=`` is a
  whole config handed on, not a field, and is not counted);
- **config fields as keywords, renamed ones included**: keyword arguments whose value is a field of a config
  section (``config.<section>.<field>``, or ``<name>.<field>`` after ``<name> = config.<section>``), under its own
  name or another (``target=r.judge``): the copies the first figure cannot see;
- **config fields**: fields of the ``Config`` aggregate and of its sections' dataclasses (declared in
  ``ctxrl/config.py``, or in the section module(s) ``ctxrl/sections*`` once they exist);
- **component-specific fields in core sections**: how many of the fields issue 50 names as one component's
  (``COMPONENT_FIELDS``) a core section still declares;
- **Trainer constructions in tests**: calls of ``Trainer(...)`` in ``tests/``, and the test files with any; the
  "any form" figure also counts ``module.Trainer(...)`` and a name ``Trainer`` was imported as (``Trainer as
  Run``), and ``experiments/`` apart;
- **reads of a trainer's attributes elsewhere**: ``trainer.<attribute>`` outside ``train/trainer.py``;
- **modules ``Config()`` imports**: ``ctxrl`` modules that constructing a default ``Config`` imports beyond
  ``ctxrl.config`` itself (run in a fresh interpreter);
- **lazy import cycles**: groups of modules that reach each other through imports anywhere in a file
  (top-level cycles are a test failure: ``tests/test_import_layers.py``).
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

COMPONENT_FIELDS = (  # issue 50's plan, section 4.3: fields one component reads, declared in a core section
    "curriculum.horizon_start_turns", "curriculum.horizon_warmup_steps", "curriculum.horizon_stages",
    "curriculum.self_paced_pool", "curriculum.self_paced_floor",
    "algo.lam", "algo.gae_level", "algo.vf_clip", "train.critic_lr",
    "meta.credit", "meta.normalize", "meta.baseline", "meta.gamma_trial",
    "algo.dual_clip",
    "context.max_summaries", "context.eval_max_summaries", "context.summary_max_tokens",
    "context.summary_instruction", "context.max_branches", "context.branch_reward",
    "env.tools", "env.verifier", "env.harness",
    "reward.judge", "reward.judge_weight", "reward.judge_model", "reward.judge_rubric", "reward.judge_input",
    "reward.judge_reference", "reward.judge_max_tokens", "reward.judge_retries", "reward.judge_timeout_s",
    "reward.judge_concurrency", "reward.judge_cache", "reward.judge_api_key_env",
    "meta.demos_max", "meta.demos_steps", "meta.demos_kind", "meta.demos_mode", "meta.demos_source",
    "meta.demos_pool",
    "report.wandb_project", "report.wandb_mode",
    "sft.shortcut_fraction", "sft.redundant_fraction", "sft.other_worlds", "sft.context_demos", "sft.trial_demos",
    "sft.format_demos_env", "sft.format_demos", "sft.format_demos_budget",
)


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


def chain(node: ast.AST) -> list[str]:
    """``a.b.c`` as ``["c", "b", "a"]`` (the attributes innermost last, then the name), or the attributes alone."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [*names, node.id] if isinstance(node, ast.Name) else names


def functions(root: Path):
    """(path, function node) of every function in ``root``."""
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, fn


def copied_fields(root: Path) -> list[str]:
    """``file:line name`` of every keyword argument ``name=<expr>.name`` that hands on a config field: in a function
    whose name says it reads a config (``from_config``, ``*settings*``, ``*config*``), or whose value's attribute
    chain passes through a name containing ``config``. ``config=x.config`` hands on a whole config (an HF model's
    too), not a field."""
    found = []
    for path, fn in functions(root):
        reads_config = any(word in fn.name for word in ("from_config", "settings", "config"))
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg and kw.arg != "config" and isinstance(kw.value, ast.Attribute) and \
                            kw.value.attr == kw.arg and (reads_config or any("config" in n for n in chain(kw.value))):
                        found.append(f"{path.relative_to(root.parent)}:{kw.value.lineno} {kw.arg}")
    return sorted(set(found))


def section_names(root: Path) -> set[str]:
    """The names of the config's sections: the fields of ``Config`` in ``ctxrl/config.py``."""
    for node in ast.parse((root / "config.py").read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "Config":
            return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)} - {"components"}
    return set()


def section_field_keywords(root: Path) -> list[tuple[str, str, str]]:
    """``(file:line, keyword, section.field)`` of every keyword argument whose value is a config section's field:
    ``config.<section>.<field>`` (``self.config`` too), or ``<alias>.<field>`` where ``<alias> = config.<section>``
    in the same function; under the field's own name or another."""
    sections, rows = section_names(root), []
    for path, fn in functions(root):
        alias = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                target, value = node.targets[0], node.value
                pairs = (list(zip(target.elts, value.elts)) if isinstance(target, ast.Tuple)
                         and isinstance(value, ast.Tuple) else [(target, value)])
                for t, v in pairs:
                    names = chain(v)[::-1]  # (outermost first: config, section)
                    if isinstance(t, ast.Name) and len(names) == 2 and "config" in names[0].lower() and \
                            names[1] in sections:
                        alias[t.id] = names[1]
        for node in ast.walk(fn):
            for kw in node.keywords if isinstance(node, ast.Call) else ():
                names = chain(kw.value)[::-1] if kw.arg and isinstance(kw.value, ast.Attribute) else []
                if names[:2] == ["self", "config"]:
                    names = names[1:]
                found = None
                if len(names) == 3 and "config" in names[0].lower() and names[1] in sections:
                    found = names[1:]
                elif len(names) == 2 and names[0] in alias:
                    found = [alias[names[0]], names[1]]
                if found:
                    rows.append((f"{path.relative_to(root.parent)}:{kw.value.lineno}", kw.arg, ".".join(found)))
    return rows


def section_files(root: Path) -> list[Path]:
    """Where the config's sections are declared: ``config.py``, and ``sections.py`` or ``sections/`` once there."""
    return [root / "config.py", *sorted(root.glob("sections.py")), *sorted((root / "sections").glob("*.py"))]


def dataclass_fields(paths: list[Path]) -> dict[str, list[str]]:
    """``{class name: [field, ...]}`` of the dataclasses declared at the top of ``paths`` (a ClassVar is no field)."""
    out = {}
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(d, ast.Name) and d.id == "dataclass" or
                    isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass" for d in node.decorator_list):
                out[node.name] = [s.target.id for s in node.body
                                  if isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(s.annotation)]
    return out


def section_classes(root: Path) -> dict[str, list[str]]:
    """``{field of Config: the fields of its class}``, the classes found in the section files (``components``, a
    plain dict, has none)."""
    classes = dataclass_fields(section_files(root))
    for node in ast.parse((root / "config.py").read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "Config":
            return {s.target.id: classes.get(ast.unparse(s.annotation), []) for s in node.body
                    if isinstance(s, ast.AnnAssign)}
    return {}


def config_fields(root: Path) -> int:
    """Fields of ``Config`` and of the section classes its fields are (other dataclasses of the loader are none)."""
    sections = section_classes(root)
    return len(sections) + sum(len(fields) for fields in sections.values())


def component_fields_in_core(root: Path) -> list[str]:
    """The ``COMPONENT_FIELDS`` a core section still declares (its class the type of that field of ``Config``)."""
    sections = section_classes(root)
    return [key for key in COMPONENT_FIELDS if key.partition(".")[2] in sections.get(key.partition(".")[0], [])]


def trainer_constructions(tests: Path) -> tuple[int, int]:
    """Calls of a bare ``Trainer(...)`` in ``tests/test_*.py``, and the files with any."""
    calls, files = 0, 0
    for path in sorted(tests.rglob("test_*.py")):
        n = sum(isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Trainer"
                for node in ast.walk(ast.parse(path.read_text())))
        calls += n
        files += n > 0
    return calls, files


def trainer_constructions_any_form(root: Path, pattern: str = "test_*.py") -> list[str]:
    """``file:line`` of every call in ``root``'s ``pattern`` files that builds a ``Trainer``: ``Trainer(...)``,
    ``module.Trainer(...)``, or a name it was imported as (``from ctxrl.train.trainer import Trainer as Run``)."""
    found = []
    for path in sorted(root.rglob(pattern)):
        tree = ast.parse(path.read_text())
        names = {"Trainer"} | {a.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                               for a in node.names if a.name == "Trainer" and a.asname}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) in names
                                               or getattr(node.func, "attr", None) == "Trainer"):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def trainer_reads(root: Path) -> collections.Counter:
    """``(file, attribute)`` -> how often ``trainer.<attribute>`` is read outside ``train/trainer.py``."""
    reads = collections.Counter()
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "train/trainer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer":
                reads[(str(path.relative_to(root.parent)), node.attr)] += 1
    return reads


def config_imports() -> list[str]:
    """The ``ctxrl`` modules that ``Config()`` imports beyond what ``import ctxrl.config`` did, in a fresh
    interpreter."""
    code = ("import sys; from ctxrl.config import Config; a = set(sys.modules); Config(); "
            "print('\\n'.join(sorted(m for m in set(sys.modules) - a if m.startswith('ctxrl'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=REPO)
    return out.stdout.split()


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


def measure(function_lines: int, class_lines: int) -> dict:
    """Every figure, as JSON values."""
    root, tests = REPO / "ctxrl", REPO / "tests"
    functions_ = definitions(root, (ast.FunctionDef, ast.AsyncFunctionDef), function_lines)
    classes = definitions(root, ast.ClassDef, class_lines)
    calls, files = trainer_constructions(tests)
    built = trainer_constructions_any_form(tests)
    keywords = section_field_keywords(root)
    reads = trainer_reads(root)
    imports = config_imports()
    cycles = lazy_cycles()
    return {"functions_over_limit": len(functions_), "longest_functions": functions_[:10],
            "classes_over_limit": len(classes), "largest_classes": classes[:10],
            "fields_copied_by_hand": len(copied_fields(root)),
            "config_field_keywords": len(keywords),
            "config_field_keywords_renamed": sum(kw != key.rpartition(".")[2] for _, kw, key in keywords),
            "config_fields": config_fields(root),
            "component_fields_in_core_sections": len(component_fields_in_core(root)),
            "trainer_constructions_in_tests": calls, "test_files_building_a_trainer": files,
            "trainer_constructions_any_form": len(built),
            "test_files_building_a_trainer_any_form": len({b.rpartition(":")[0] for b in built}),
            "trainer_constructions_in_experiments":
                len(trainer_constructions_any_form(REPO / "experiments", "*.py")),
            "trainer_reads_elsewhere": sum(reads.values()), "trainer_reads_elsewhere_distinct": len(reads),
            "modules_imported_by_Config()": len(imports),
            "lazy_import_cycles": [len(c) for c in cycles], "largest_lazy_cycle": cycles[0] if cycles else []}


def compare(before: dict, now: dict) -> list[str]:
    """``name: before -> now`` for every number (or list of numbers) the two share."""
    return [f"  {key}: {before[key]} -> {value}" for key, value in now.items()
            if key in before and (isinstance(value, int) or key == "lazy_import_cycles")]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--function-lines", type=int, default=60)
    parser.add_argument("--class-lines", type=int, default=250)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--compare", metavar="BEFORE.json", help="a --json output to compare each figure with")
    args = parser.parse_args(argv)
    f = measure(args.function_lines, args.class_lines)
    if args.json:
        print(json.dumps(f, indent=1))
        return f
    print(f"functions over {args.function_lines} lines: {f['functions_over_limit']}")
    for lines, name in f["longest_functions"]:
        print(f"  {lines:4d}  {name}")
    print(f"classes over {args.class_lines} lines: {f['classes_over_limit']}")
    for lines, name in f["largest_classes"]:
        print(f"  {lines:4d}  {name}")
    print(f"config fields: {f['config_fields']}; keyword arguments copying a field by hand (name=x.name): "
          f"{f['fields_copied_by_hand']}; config fields as keywords: {f['config_field_keywords']} "
          f"({f['config_field_keywords_renamed']} under another name)")
    print(f"component-specific fields in core sections: {f['component_fields_in_core_sections']} "
          f"of {len(COMPONENT_FIELDS)}")
    print(f"Trainer(...) constructions in tests: {f['trainer_constructions_in_tests']} in "
          f"{f['test_files_building_a_trainer']} files; in any form: {f['trainer_constructions_any_form']} in "
          f"{f['test_files_building_a_trainer_any_form']} files (+{f['trainer_constructions_in_experiments']} in "
          "experiments/)")
    print(f"trainer.<attribute> reads outside train/trainer.py: {f['trainer_reads_elsewhere']} "
          f"({f['trainer_reads_elsewhere_distinct']} distinct file and attribute)")
    print(f"ctxrl modules Config() imports: {f['modules_imported_by_Config()']}")
    print(f"import cycles through lazy imports: {len(f['lazy_import_cycles'])} (modules in each: "
          f"{f['lazy_import_cycles']})")
    if args.compare:
        print(f"before ({args.compare}) -> now:")
        print("\n".join(compare(json.loads(Path(args.compare).read_text()), f)))
    return f


if __name__ == "__main__":
    main()
