"""The SFT-only control (``train.objective=sft``) and the format-only warm start (``sft.format_demos_env``): the
controls an RL claim is measured against (issue 49)."""

from __future__ import annotations

import json

import pytest

from ctxrl.config import ConfigError, load_config
from ctxrl.seeds import Seeds
from ctxrl.train.sft_control import split_rows, updates_per_step


def test_the_control_takes_as_many_optimiser_steps_as_an_rl_step():
    config = load_config(None, ["train.ppo_epochs=2", "train.mini_batches=3"])
    assert updates_per_step(config) == 6


def test_the_controls_demos_keep_the_warm_starts_mix_and_are_fresh_each_step(tiny_path):
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_env_class, spec_renderer
    from ctxrl.train.warm_start import demo_mix

    config = load_config(None, [f"model.name={tiny_path}", "env.name=fact_hunt", "env.max_turns=6",
                                "context.manager=summarize", "context.max_context_tokens=400",
                                "rollout.max_total_tokens=1024", "rollout.max_new_tokens=32", "sft.demos=30",
                                "sft.format_demos_env=search_join", "sft.format_demos=10",
                                "sft.format_demos_budget=600"])
    spec = RolloutSpec.from_config(config)
    env_cls, renderer = spec_env_class(spec), spec_renderer(spec)

    def mix(n, seed):
        demos = demo_mix(config, spec, env_cls, renderer, n, under_manager=False, seeds=(seed, seed + 1, seed + 2))
        own = [e for e in demos if e.task.id.startswith("fact_hunt")]
        other = [e for e in demos if e.task.id.startswith("search_join")]
        assert len(own) + len(other) == len(demos)
        return own, other

    own, other = mix(12, 5)
    assert len(own) == 12 and len(other) == 4  # 10 format demos to 30 of the run's own, as in the warm start
    assert {e.task.id for e in mix(12, 6)[0]} != {e.task.id for e in own}  # another step, other tasks
    seeds = Seeds(3)
    assert len({seeds.control_demos(s) for s in range(50)} | {seeds.warm_start_demos, seeds.format_demos}) == 52


def test_split_rows_gives_equal_batches_that_keep_every_row():
    rows = list(range(10))
    assert split_rows(rows, 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split_rows(rows[:2], 4) == [[0], [1]]


@pytest.mark.parametrize("overrides, message", [
    (["sft.format_demos=10"], "needs sft.format_demos_env"),
    (["env.name=fact_hunt", "sft.format_demos_env=fact_hunt", "sft.format_demos=4", "context.manager=summarize",
      "context.max_context_tokens=384"], "the run's own environment"),
    (["env.name=fact_hunt", "sft.format_demos_env=search_join", "sft.format_demos=4"], "makes none"),
    (["env.name=fact_hunt", "sft.format_demos_env=search_join", "context.manager=summarize",
      "context.max_context_tokens=384"], "needs sft.format_demos > 0"),
    (["env.name=fact_hunt", "sft.format_demos_env=calculator", "sft.format_demos=4", "context.manager=summarize",
      "context.max_context_tokens=384"], "has no summary"),
    (["env.name=fact_hunt", "sft.format_demos_env=nope", "sft.format_demos=4", "context.manager=summarize",
      "context.max_context_tokens=384"], "sft.format_demos_env"),
    (["env.name=fact_hunt", "sft.format_demos_env=search_join", "sft.format_demos=4", "context.manager=summarize",
      "context.max_context_tokens=384", "sft.context_demos=on"], "sft.context_demos=on"),
    (["train.objective=sft", "sft.enabled=false"], "needs sft.enabled=true"),
    (["train.objective=ppo"], "train.objective must be one of rl, sft"),
])
def test_bad_control_and_format_settings_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_control_run_trains_on_fresh_demos_and_is_evaluated_like_an_rl_run(tmp_path, tiny_path):
    import torch

    from ctxrl.models.loader import load_model
    from ctxrl.train.trainer import train

    overrides = [f"model.name={tiny_path}", "env.name=fact_hunt", "env.max_turns=6", "context.manager=summarize",
                 "context.max_context_tokens=400", "rollout.max_total_tokens=1024", "rollout.max_new_tokens=32",
                 "sft.demos=4", "sft.batch_size=2", "sft.epochs=1", "sft.lr=1e-3", "sft.format_demos_env=search_join",
                 "sft.format_demos=2", "sft.format_demos_budget=600", "train.objective=sft", "train.mini_batches=2",
                 "train.eval_every=1", "eval.tasks=2", "run.progress=false"]
    summary = train(load_config(None, [*overrides, "train.steps=2"]), tmp_path / "control")
    tmp_path = tmp_path / "control"
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sft = next(r for r in rows if r["phase"] == "sft")
    assert sft["format_demos"] == 2 and sft["demos"] == 6 and not sft["context_demos"]
    assert sft["demo_summaries_per_episode"] > 0  # the other environment's demos summarise; the run's own do not
    control = [r for r in rows if r["phase"] == "sft_control"]
    assert [r["step"] for r in control] == [1, 2] and all(r["optimizer_steps"] == 2 for r in control)
    assert all(r["trained_sequences"] == 4 for r in control) and not any(r["phase"] == "rl" for r in rows)
    evals = [r["step"] for r in rows if r["phase"] == "eval" and r["split"] == "heldout"]
    assert evals == [0, 1, 2]  # the RL run's cadence
    assert all(len(r["task_success"]) == 2 for r in rows if r["phase"] == "eval")
    assert summary["objective"] == "sft"
    warm_only = train(load_config(None, [*overrides, "train.steps=0"]), tmp_path / "warm")
    assert warm_only["sft_loss_last"] == summary["sft_loss_last"]  # the same warm start
    before = load_model(warm_only["checkpoint"], dtype="float32", device="cpu")
    after = load_model(summary["checkpoint"], dtype="float32", device="cpu")
    assert all(not torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters()))  # the control trained


def test_a_format_only_run_config_still_loads_for_evaluation_without_a_warm_start():
    """``ctxrl eval`` reads the run's own config.toml with the warm start off: its format demos are simply unused."""
    config = load_config(None, ["env.name=fact_hunt", "context.manager=summarize", "context.max_context_tokens=384",
                                "sft.format_demos_env=search_join", "sft.format_demos=150", "sft.enabled=false"])
    assert config.sft.format_demos_env == "search_join"
