"""Smoke tests: the whole pipeline (warm start, eval, RL, eval) runs on the tool environments.

On the random-init tiny model, so they check plumbing, not learning; the learning figures come
from ``benchmarks/env_training.py`` (docs/environments.md).
"""

from __future__ import annotations

import json

import pytest

from ctxrl.config import load_config
from ctxrl.train.trainer import train

SMALL = ["model.name=tiny:pretrain_steps=0", "sft.demos=6", "sft.epochs=1", "sft.batch_size=3", "eval.tasks=2",
         "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=24",
         "rollout.max_total_tokens=1024", "run.progress=false", "train.steps=1", "train.eval_every=0"]


@pytest.mark.parametrize("env", ["python_math", "search_qa", "sokoban"])
def test_pipeline_runs_on_tool_env(env, tmp_path):
    config = load_config(None, [f"env.name={env}", *SMALL])
    summary = train(config, tmp_path / env)
    assert summary["steps"] == 1
    for split in ("train", "heldout", "ood"):
        assert 0.0 <= summary[f"{split}_success_after"] <= 1.0
    rows = [json.loads(line) for line in (tmp_path / env / "metrics.jsonl").read_text().splitlines()]
    sft = next(r for r in rows if r["phase"] == "sft")
    assert sft["demos"] == 6 and sft["sft_loss_last"] == sft["sft_loss_last"]  # finite
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 1 and rl[0]["tokens"] > 0
    assert {r["split"] for r in rows if r["phase"] == "eval"} == {"train", "heldout", "ood"}
