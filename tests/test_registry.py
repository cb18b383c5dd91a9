"""The registry every extension point shares: built-ins first, entry points, clear errors."""

from __future__ import annotations

import pytest

from ctxrl.registry import Registry


class FakeEntryPoint:
    def __init__(self, name: str, obj) -> None:
        self.name, self.obj, self.loads = name, obj, 0

    def load(self):
        self.loads += 1
        return self.obj


class A:
    pass


class B:
    pass


def test_builtins_first_entry_points_on_demand_and_clear_errors(monkeypatch):
    point = FakeEntryPoint("from_package", B)
    monkeypatch.setattr("ctxrl.registry.entry_points", lambda group: [point] if group == "test.group" else [])
    registry: Registry[type] = Registry("widget", ("ctxrl.envs.calculator",), entry_point_group="test.group")
    registry.register("a", A)
    assert registry.names() == ["a", "from_package"] and point.loads == 0  # listed, not loaded yet
    assert registry.get("from_package") is B and registry.get("from_package") is B and point.loads == 1
    assert "a" in registry and "nope" not in registry
    registry.register("a", A)  # the same class again (a reloaded module) is fine
    with pytest.raises(ValueError, match="widget name 'a' is already registered to .*A; pick another name for .*B"):
        registry.register("a", B)
    with pytest.raises(ValueError, match="unknown widget 'from_pakage'; did you mean 'from_package'\\? known widgets"):
        registry.get("from_pakage")


def test_the_three_registries_read_their_entry_point_groups(monkeypatch):
    from ctxrl.algo.estimators.base import ESTIMATORS, Estimator
    from ctxrl.envs.registry import ENVIRONMENTS
    from ctxrl.rollout.managers.base import MANAGERS, ContextManager

    class Outside(ContextManager):
        name = "outside"

    class OutsideEstimator(Estimator):
        name = "outside_estimator"

    for registry in (MANAGERS, ESTIMATORS):  # whatever the test loads is forgotten afterwards
        registry.load_builtins()
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    groups = {"ctxrl.managers": [FakeEntryPoint("outside", Outside)],
              "ctxrl.estimators": [FakeEntryPoint("outside_estimator", OutsideEstimator)]}
    monkeypatch.setattr("ctxrl.registry.entry_points", lambda group: groups.get(group, []))
    assert MANAGERS.get("outside") is Outside and ESTIMATORS.get("outside_estimator") is OutsideEstimator
    assert ENVIRONMENTS.entry_point_group == "ctxrl.envs" and "calculator" in ENVIRONMENTS.names()
    assert MANAGERS.names()[:4] == ["full", "window", "summarize", "fold"]  # built-ins first


def test_every_built_in_module_registers_and_every_name_resolves():
    """Each module a registry names among its built-ins (named by the package above the registry's module:
    ``Registry.add_builtins``) registers at least one class, which its name gives back."""
    from ctxrl.algo.estimators.base import ESTIMATORS
    from ctxrl.chat.formats.base import FORMATS
    from ctxrl.envs.registry import ENVIRONMENTS
    from ctxrl.rollout.managers.base import MANAGERS

    for registry in (ESTIMATORS, FORMATS, ENVIRONMENTS, MANAGERS):
        names = registry.names()
        registered = {registry.get(name).__module__ for name in names}
        assert registry.builtins and set(registry.builtins) <= registered, registry.kind
        assert names == list(dict.fromkeys(names)), registry.kind


def test_the_built_in_names_resolve_from_any_entry_point():
    """A fresh interpreter that imports only a registry's own module finds every built-in name: ``meta`` among
    the estimators, ``harness`` among the environments (neither in the registry's package). A checked config is
    enough for the episode runners of the packages above rollout (trials, the harness), which rollout never
    imports."""
    import json
    import subprocess
    import sys

    code = """
import json
from ctxrl.algo.estimators.base import ESTIMATORS
from ctxrl.chat.formats.base import FORMATS
from ctxrl.envs.registry import ENVIRONMENTS
names = {r.kind: sorted(r.names()) for r in (ESTIMATORS, FORMATS, ENVIRONMENTS)}
from ctxrl.config import load_config
from ctxrl.rollout.runners import RUNNERS
load_config(None, [])
print(json.dumps({**names, RUNNERS.kind: sorted(RUNNERS.names())}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    names = json.loads(done.stdout.strip().splitlines()[-1])
    assert names["advantage estimator"] == ["distill", "dr_grpo", "gae", "grpo", "meta", "rae", "reinforce_pp",
                                              "rloo", "turn_grpo", "turn_loo"]
    assert names["tool format"] == ["hermes", "llama3_json", "mistral", "pythonic"]
    assert {"calculator", "harness", "jsonl_tools", "kuhn_poker", "propose_solve"} <= set(names["environment"])
    assert names["episode runner"] == ["harness", "meta", "plain", "roles"]
