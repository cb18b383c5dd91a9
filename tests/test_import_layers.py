"""The import direction docs/architecture.md promises, read from the source (no module is imported).

Every package has a layer (``LAYERS``); a module may import its own package and any package of a lower or
equal layer. An import counts wherever it is written: at the top of a file, inside a function (a lazy
import), or as a module named in a string (a registry's built-ins, ``"ctxrl.envs.calculator"``). The imports
that still point upward are listed in ``UPWARD`` by module: the redesign removes them, and this test
fails both when a new one appears and when a listed one is gone (so the list only shrinks, and stays true).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ctxrl"

LAYERS = {
    # plain data, errors, the registry every extension point uses, prompts, seeds, the config's sections
    "plain": 0, "types": 0, "errors": 0, "registry": 0, "plugins": 0, "prompts": 0, "seeds": 0, "settings": 0,
    "sections": 0,
    # chat templates, tools, task spaces, the algorithms' maths, metric sinks and plots
    "chat": 1, "tools": 1, "tasks": 1, "algo": 1, "report": 1,
    "models": 2, "engine": 3, "envs": 4, "judge": 4, "rollout": 5,
    "meta": 6, "eval": 6, "demos": 6, "serve": 6, "learner": 6,
    "distributed": 7, "config": 8, "run": 8, "train": 8, "cli": 9, "__main__": 10,
}

# Module (without "ctxrl.") -> the packages above its own that it still imports. To remove, not to extend.
UPWARD: dict[str, list[str]] = {}

MODULE_NAME = re.compile(r"ctxrl(\.[A-Za-z_][A-Za-z0-9_]*)+")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def entry_point_groups(tree: ast.AST) -> set[int]:
    """The string constants that name an entry-point group (``entry_point_group="ctxrl.envs"``, or assigned to an
    ``ENTRY_POINT_GROUP``): a group's name, not a module, so not an import."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_point_group" and isinstance(node.value, ast.Constant):
            found.add(id(node.value))
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
              and any(isinstance(t, ast.Name) and t.id.endswith("ENTRY_POINT_GROUP") for t in node.targets)):
            found.add(id(node.value))
    return found


def type_checking_only(tree: ast.AST) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:``: imports for type checkers, which never run."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            found.update(id(n) for child in node.body for n in ast.walk(child))
    return found


def imported_names(module: str, path: Path, *, load_time_only: bool = False, runtime_only: bool = False) -> set[str]:
    """Every ``ctxrl...`` name the file imports or names as a module string, absolute (``load_time_only``: only the
    imports at the top of the file, which run when it loads; ``runtime_only``: not those under ``if
    TYPE_CHECKING:``, which never run)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text())
    groups = entry_point_groups(tree)
    skipped = type_checking_only(tree) if runtime_only else set()
    names = set()
    for node in tree.body if load_time_only else ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or "" if node.level == 0 else ".".join(
                package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value)
              and id(node) not in groups):
            names.add(node.value)
    return {n for n in names if n.startswith("ctxrl.")}


def module_graph(*, load_time_only: bool = False, runtime_only: bool = False) -> dict[str, set[str]]:
    """Module -> the other ctxrl modules it imports (a name such as ``ctxrl.x.y.Class`` counts as ``ctxrl.x.y``)."""
    known = modules()
    graph = {}
    for module, path in known.items():
        targets = set()
        for name in imported_names(module, path, load_time_only=load_time_only, runtime_only=runtime_only):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def package_of(name: str) -> str:
    return name.split(".")[1]


def upward_imports() -> dict[str, list[str]]:
    upward = defaultdict(set)
    for module, targets in module_graph().items():
        if module == "ctxrl":
            continue
        source = package_of(module)
        for name in targets:
            if name == "ctxrl":
                continue
            target = package_of(name)
            if target != source and LAYERS[target] > LAYERS[source]:
                upward[module.removeprefix("ctxrl.")].add(target)
    return {module: sorted(targets) for module, targets in sorted(upward.items())}


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in modules() if m != "ctxrl"}
    missing = sorted(packages - set(LAYERS))
    assert not missing, f"give {missing} a layer in LAYERS (and in docs/architecture.md's table)"


def test_imports_point_down_except_the_listed_debt():
    found = upward_imports()
    new = {m: t for m, t in found.items() if UPWARD.get(m) != t}
    gone = {m: t for m, t in UPWARD.items() if m not in found}
    assert not new, (f"imports that point up a layer (LAYERS): {new}. Move the code to the lower package, pass "
                     "the object in, or register it by name from the upper package")
    assert not gone, f"these upward imports are gone: delete them from UPWARD: {gone}"


def test_nothing_imports_the_cli():
    users = [m for m, targets in module_graph().items() if "ctxrl.cli" in targets and m != "ctxrl.__main__"]
    assert users == []


def test_no_cycle_among_top_level_imports():
    """Imports at the top of a file (those run when the module loads) form no cycle."""
    assert (cycle := first_cycle(module_graph(load_time_only=True))) is None, \
        f"an import cycle at load time: {' -> '.join(cycle)}"


def test_no_cycle_at_all():
    """Nor do all of them, the imports inside functions and the modules named in strings included (only those
    for type checkers, under ``if TYPE_CHECKING:``, never run): no module reaches back to itself."""
    assert (cycle := first_cycle(module_graph(runtime_only=True))) is None, f"an import cycle: {' -> '.join(cycle)}"


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path, module, target]
            if target not in state and (cycle := visit(target, [*path, module])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [])):
            return cycle
    return None
