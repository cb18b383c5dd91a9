"""Metric sinks: TensorBoard event files read back with TensorBoard's own reader, W&B offline, clear errors."""

from __future__ import annotations

import json

import pytest

from ctxrl.config import ConfigError, load_config
from ctxrl.report.sinks import TensorBoardSink, episode_markdown, scalars, sink_names

SMALL = ["model.name=tiny:pretrain_steps=0", "sft.demos=4", "sft.epochs=1", "sft.batch_size=4", "eval.tasks=2",
         "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "run.progress=false",
         "train.eval_every=0", "run.samples_per_step=2"]


def accumulator(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_a_run_writes_its_metrics_and_samples_to_tensorboard_and_wandb(tmp_path, monkeypatch):
    from ctxrl.train.trainer import train

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train(load_config(None, [*SMALL, "train.steps=2", "report.sinks=tensorboard,wandb"]), run)
    events = accumulator(run / "tensorboard")
    tags = events.Tags()
    assert {"rl/reward", "rl/loss", "rl/grad_norm", "eval/heldout/success", "sft/sft_loss_last"} <= set(tags["scalars"])
    assert [e.step for e in events.Scalars("rl/reward")] == [1, 2]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [e.value for e in events.Scalars("rl/loss")] == pytest.approx([r["loss"] for r in rl])
    assert [e.step for e in events.Scalars("eval/heldout/success")] == [0, 2]
    assert "samples/rl/text_summary" in tags["tensors"]  # sample episodes as a text panel
    text = events.Tensors("samples/rl/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "task `calculator-" in text and "**" in text  # the trained (mask 1) tokens in bold
    offline = list((run / "wandb").glob("offline-run-*"))
    assert offline and list(offline[0].glob("*.wandb")), "W&B wrote no offline run"


def test_a_resumed_run_purges_the_steps_it_redoes(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for step in (1, 2, 3):
        sink.log_metrics({"phase": "rl", "step": step, "reward": float(step)})
    sink.rewind(1)
    sink.log_metrics({"phase": "rl", "step": 2, "reward": 20.0})
    sink.close()
    assert [(e.step, e.value) for e in accumulator(tmp_path).Scalars("rl/reward")] == [(1, 1.0), (2, 20.0)]


def test_rows_and_episodes_for_the_sinks():
    assert scalars({"phase": "eval", "step": 3, "split": "ood", "success": 0.5, "note": "x", "ok": True}) == \
        ("eval/ood/", 3, {"success": 0.5, "ok": 1.0})
    assert scalars({"phase": "note", "step": 0, "skipped_splits": ["ood"]}) is None
    record = {"phase": "rl", "task_id": "t", "split": "train", "reward": 1.0, "success": True, "truncation": None,
              "tool_calls": 1, "spans": [{"mask": 0, "text": "prompt\n"}, {"mask": 1, "text": "answer"}]}
    assert episode_markdown(record).endswith("prompt  \n**answer**")
    assert sink_names("tensorboard, jsonl") == ["jsonl", "tensorboard"]
    with pytest.raises(ConfigError, match="report.sinks: unknown sink 'tensorbord'"):
        load_config(None, ["report.sinks=tensorbord"])
    with pytest.raises(ConfigError, match="report.wandb_mode must be one of offline, online, disabled"):
        load_config(None, ["report.wandb_mode=cloud"])
