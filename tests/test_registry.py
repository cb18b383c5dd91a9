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
