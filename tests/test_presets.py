"""Every algorithm preset under examples/presets/ loads and runs RL steps end to end.

The random-init tiny model earns no reward, so rewards are replaced by seeded coin flips (before
shaping, as an environment's would be): every advantage estimator, loss, filter and shaping term
then has non-zero signal to work on.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

import ctxrl.train.collect as collect
from ctxrl.config import load_config
from ctxrl.run.build import build, start_learning
from ctxrl.run.step import rl_step, sync_engine

PRESETS = sorted((Path(__file__).parents[1] / "examples" / "presets").glob("*.toml"))
SMALL = ["model.name=tiny:pretrain_steps=0", "sft.enabled=false", "rollout.tasks_per_step=3", "rollout.group_size=3",
         "rollout.max_new_tokens=12", "train.micro_batch_size=4", "run.progress=false", "run.samples_per_step=0"]


def test_presets_exist():
    names = {p.stem for p in PRESETS}
    assert {"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "turn_grpo", "otc_grpo", "ppo"} <= names
    assert {"cispo", "gmpo", "sapo"} <= names  # (issue 52's losses, each chosen by name)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_runs_rl_steps(preset, tmp_path, monkeypatch):
    rng = random.Random(preset.stem)
    real = collect.shape_rewards

    def coin_flips(episodes, rc, **kw):
        for e in episodes:
            e.reward = float(rng.random() < 0.5)
            e.success = bool(e.reward)
            if e.turns:
                e.turns[-1].reward = e.reward
        return real(episodes, rc, **kw)

    monkeypatch.setattr(collect, "shape_rewards", coin_flips)
    config = load_config(preset, SMALL)
    run = build(config, tmp_path / "run")
    start_learning(run)
    rows = [rl_step(run, step) for step in range(2)]
    for row in rows:
        assert "void_turn_rate" in row and "advantage_abs_mean" in row
        if config.algo.void_turn_filter:
            # random text never calls the tool or answers: every trajectory has a void turn
            assert row["void_turn_rate"] == 1.0 and row["trained_episodes"] == 0
            assert row["void_turn_filtered"] == 9 and "loss" not in row
            # the rest of the preset (its estimator and loss) still trains without the filter
            unfiltered = build(load_config(preset, [*SMALL, "algo.void_turn_filter=false"]), tmp_path / "nf")
            start_learning(unfiltered)
            row = rl_step(unfiltered, 0)
            assert row["trained_episodes"] == 9 and math.isfinite(row["loss"]) and row["advantage_abs_mean"] > 0
            continue
        assert row["trained_episodes"] > 0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["skipped"] == 0.0
        assert row["advantage_abs_mean"] > 0
    if config.algo.dynamic_sampling:
        assert all(row["dynamic_sampling_groups_kept"] <= config.rollout.tasks_per_step for row in rows)
        assert all("dynamic_sampling_rounds" in row for row in rows)
    if config.reward.otc_weight:
        assert all("reward_otc" in row for row in rows)
    if config.algo.kl_coef:
        assert all(row["kl"] >= 0 for row in rows)


def test_kl_as_a_reward_penalty(tmp_path, monkeypatch):
    config = load_config(PRESETS[0].parent / "reinforce_pp.toml",
                         [*SMALL, "algo.kl_coef=0.5", "algo.kl_placement=reward"])
    run = build(config, tmp_path / "run")
    learner = start_learning(run)
    assert learner.settings.kl_coef == 0.0 and learner.reference is not None  # not in the loss
    with torch.no_grad():  # move the policy off the reference so the KL is not zero
        for p in run.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    sync_engine(run, 0)  # the engine samples with the moved policy too
    row = rl_step(run, 0)
    assert row["kl_reward"] > 0 and "kl" not in row
    assert math.isfinite(row["loss"])


def test_turn_level_gae(tmp_path, monkeypatch):
    rng = random.Random(7)
    real = collect.shape_rewards

    def coin_flips(episodes, rc, **kw):
        for e in episodes:
            e.reward = float(rng.random() < 0.5)
            if e.turns:
                e.turns[-1].reward = e.reward
        return real(episodes, rc, **kw)

    monkeypatch.setattr(collect, "shape_rewards", coin_flips)
    config = load_config(PRESETS[0].parent / "ppo.toml", [*SMALL, "algo.gae.level=turn"])
    run = build(config, tmp_path / "run")
    start_learning(run)
    row = rl_step(run, 0)
    assert math.isfinite(row["loss"]) and math.isfinite(row["vf_loss"]) and row["vf_loss"] > 0
    assert 0.0 <= row["vf_clip_frac"] <= 1.0


# The hub models' presets (the offline SmolLM2 presets are the real-model demo's: tests/test_real_model.py).
MODELS = sorted((Path(__file__).parents[1] / "examples" / "models").glob("qwen*.toml"))


def test_real_model_presets_suit_a_pretrained_policy():
    """No deliberately-bad warm start, an RL learning rate near 1e-6 (1e-5 for LoRA), long turns, bf16."""
    assert {p.stem for p in MODELS} >= {"qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", "qwen2.5-7b-instruct-lora"}
    for preset in MODELS:
        c = load_config(preset)
        assert not c.sft.enabled and c.model.dtype == "bfloat16" and c.train.master_weights == "float32", preset
        assert c.rollout.max_new_tokens >= 256 and c.train.max_tokens_per_microbatch > 0, preset
        assert c.train.lr <= (1e-5 if c.lora.rank else 2e-6), preset
        assert c.model.name.startswith("Qwen/"), preset
    lora = load_config(MODELS[-1])
    assert lora.lora.rank > 0 and lora.train.gradient_checkpointing


@pytest.mark.parametrize("preset", [MODELS[0], MODELS[-1]], ids=lambda p: p.stem)
def test_a_real_model_preset_trains_the_tiny_model_in_bf16(preset, tmp_path):
    """The preset as a user runs it, on the tiny model on a CPU: bf16 weights, float32 masters, chunked
    log-probs, token-budget micro-batches (and LoRA with gradient checkpointing for the 7B preset)."""
    from ctxrl.train.trainer import train

    summary = train(load_config(preset, ["model.name=tiny:pretrain_steps=0", "model.device=cpu", "train.steps=1",
                                         "rollout.tasks_per_step=2", "rollout.group_size=2",
                                         "rollout.max_new_tokens=12", "rollout.max_total_tokens=512",
                                         "eval.tasks=2", "run.progress=false", "train.max_tokens_per_microbatch=64"]),
                    tmp_path)
    assert summary["steps"] == 1 and summary["skipped_updates"] == 0
    final = Path(summary["checkpoint"])
    assert (final / ("adapter_model.safetensors" if "lora" in preset.stem else "model.safetensors")).exists()
