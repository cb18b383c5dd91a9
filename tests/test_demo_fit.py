"""Demos that cannot fit the context budget stop the run before its model loads (issue 31 lost GPU runs to a
budget found too small only after loading: ``select`` at 384 SmolLM2 tokens)."""

from __future__ import annotations

import pytest

from ctxrl.config import load_config
from ctxrl.errors import ConfigError


def config(manager: str, budget: int, *extra: str):
    return load_config(None, ["model.name=tiny", "env.name=fact_hunt", "env.max_turns=6", f"context.manager={manager}",
                              f"context.max_context_tokens={budget}", f"context.{manager}.max_summaries=4",
                              "rollout.max_new_tokens=48", "rollout.max_total_tokens=1024", "sft.demos=100",
                              "run.progress=false", *extra])


def test_a_budget_the_demos_cannot_fit_stops_before_the_model_loads(tmp_path, monkeypatch):
    from ctxrl.learner.policy import Policy
    from ctxrl.run.build import build

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(Policy, "load", no_load)
    with pytest.raises(ConfigError, match=r"do not fit the context budget \(found before loading the model, on 64 of "
                                          r"them\): demonstration for task fact_hunt-\w+ ended early \(max_context\)"):
        build(config("select", 320), tmp_path / "run")


def test_a_budget_the_demos_cannot_fit_stops_before_a_tiny_model_is_built(tmp_path, monkeypatch):
    """A tiny model not built yet takes minutes on a CPU: the demos are checked on its tokenizer alone first."""
    from ctxrl.train import tiny, trainer

    def no_build(*args, **kwargs):
        raise AssertionError("the tiny model must not be built")

    monkeypatch.setenv("CTXRL_CACHE", str(tmp_path / "cache"))  # (nothing built there)
    monkeypatch.setattr(tiny, "build_tiny", no_build)
    with pytest.raises(ConfigError, match=r"do not fit the context budget \(found before loading the model"):
        trainer.train(config("select", 320), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_demos_that_fit_or_need_no_manager_pass(tmp_path):
    from ctxrl.envs.registry import get_env_class
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_renderer
    from ctxrl.train.warm_start import check_demos_fit

    fits = config("summarize", 448)
    spec = RolloutSpec.from_config(fits)
    renderer = spec_renderer(spec)
    env_cls = get_env_class("fact_hunt")
    check_demos_fit(fits, spec, env_cls, renderer, under_manager=True)  # summaries keep it within 448
    tight = config("select", 320)
    check_demos_fit(tight, RolloutSpec.from_config(tight), env_cls, renderer, under_manager=False)  # full-context demos
    off = config("select", 320, "sft.enabled=false")
    check_demos_fit(off, RolloutSpec.from_config(off), env_cls, renderer, under_manager=True)  # no warm start
    with pytest.raises(ConfigError):
        check_demos_fit(tight, RolloutSpec.from_config(tight), env_cls, renderer, under_manager=True)
