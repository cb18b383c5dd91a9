"""Reliability guarantees (docs/reliability.md): exact resume, atomic checkpoints, NaN guards,
deadlines and errored episodes, graceful stop, and clear errors for bad input.

All on the random-init tiny model on CPU in fp32 with a fixed seed.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ctxrl.algo.estimators import broadcast
from ctxrl.algo.estimators.outcome import GRPO
from ctxrl.config import ConfigError, load_config
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.envs.registry import register
from ctxrl.errors import CheckpointError
from ctxrl.run import loop
from ctxrl.run.build import build, start_learning
from ctxrl.run.step import rl_step
from ctxrl.train import checkpoint
from ctxrl.train import checkpoint_io as ckpt
from ctxrl.train.trainer import TrainingAborted, train
from ctxrl.types import TrainSequence

ROOT = Path(__file__).parents[1]
SMALL = ["model.name=tiny:pretrain_steps=0", "sft.demos=8", "sft.epochs=1", "sft.batch_size=4", "eval.tasks=2",
         "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12", "run.progress=false",
         "train.eval_every=0", "run.samples_per_step=1", "train.checkpoint_every=1"]
VOLATILE = {"time_rollout", "time_update", "time_step", "seconds"}


def config(*extra: str):
    return load_config(None, [*SMALL, *extra])


def rl_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows if r["phase"] == "rl"]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))


@pytest.fixture
def learning_signal(monkeypatch):
    """Advantages of +1 / -1 (alternating within each group): the random-init model earns no reward, and
    without a learning signal an exactness test would compare runs whose weights never moved."""
    def estimate(self, episodes, **kw):
        return [broadcast(e, 1.0 if i % 2 else -1.0) for i, e in enumerate(episodes)]

    monkeypatch.setattr(GRPO, "estimate", estimate)


# -- (a) exact resume ---------------------------------------------------------------------------
def test_resume_gives_the_same_losses_rewards_and_weights(tmp_path, learning_signal):
    full = tmp_path / "full"
    train(config("train.steps=4"), full)
    split = tmp_path / "split"
    train(config("train.steps=2"), split)
    assert (split / "checkpoints" / "latest").read_text().strip() == "step-000002"
    summary = train(config("train.steps=4"), split, resume=True)
    assert summary["resumed_from"] == 2
    a, b = rl_rows(full), rl_rows(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # every step exactly once
    for ra, rb in zip(a, b):
        for key in ("loss", "reward", "success", "tokens", "grad_norm", "approx_kl", "entropy"):
            assert ra[key] == rb[key], (ra["step"], key)
    wa, wb = final_weights(full), final_weights(split)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # and the runs did learn: every step updated, and the weights moved away from the warm start
    assert all(r["no_signal"] == 0.0 and r["grad_norm"] > 0 for r in a)
    w0 = load_file(str(full / "checkpoints" / "step-000000" / "model.safetensors")) \
        if (full / "checkpoints" / "step-000000").exists() else None
    start = w0 or load_file(str(split / "checkpoints" / "step-000002" / "model.safetensors"))
    assert any(not torch.equal(start[k], wa[k]) for k in wa)
    # the first part's final evaluation was moved aside, not lost
    orphaned = [json.loads(x) for x in (split / "metrics.orphaned.jsonl").read_text().splitlines()]
    assert orphaned and all(r["phase"] == "eval" and r["step"] == 2 for r in orphaned)
    evals = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in evals if r["phase"] == "eval") == [0, 0, 0, 4, 4, 4]
    assert len(list((split / "checkpoints").glob("step-*"))) == 3  # keep_checkpoints


def test_checkpoint_holds_every_piece(tmp_path, learning_signal):
    train(config("train.steps=1", "curriculum.kind=self_paced"), tmp_path)
    path = ckpt.latest_checkpoint(tmp_path / "checkpoints")
    for name in ckpt.REQUIRED + ("model.safetensors", "config.json", "tokenizer.json"):
        assert (path / name).exists(), name
    state = json.loads((path / "state.json").read_text())
    assert state["step"] == 1 and state["policy_version"] == 1
    assert state["curriculum"]["counts"]  # the self-paced success counts travel with the run
    assert state["logs"]["metrics.jsonl"] > 0
    optimizer = ckpt.load_state(path, "optimizer")
    assert optimizer["state"] and all("exp_avg" in s for s in optimizer["state"].values())
    rng = ckpt.load_state(path, "rng")
    assert {"python", "numpy", "torch", "gen:learner"} <= set(rng)


def test_rng_state_round_trips():
    import random

    import numpy as np

    gen = torch.Generator().manual_seed(3)
    state = ckpt.rng_state({"g": gen})
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gen)))
    ckpt.set_rng_state(state, {"g": gen})
    again = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gen)))
    assert first == again


# -- (b) SIGKILL mid-run, (graceful stop) -------------------------------------------------------
def ctxrl(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "ctxrl.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.stderr.read()[-3000:]}")
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any(json.loads(x).get("step") == step and json.loads(x)["phase"] == "rl"
                                    for x in metrics.read_text().splitlines() if x.strip()):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged")


def test_sigkill_mid_step_resumes_and_finishes(tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", str(ROOT / "examples" / "calculator_tiny.toml"), "--run-dir", str(run_dir), "--json",
            "train.steps=4", *SMALL]
    proc = ctxrl(*args, cwd=tmp_path)
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGKILL)  # somewhere in step 3 (or saving step 2)
    proc.wait()
    resumed = ctxrl(*args, "--resume", cwd=tmp_path)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["resumed_from"] in (1, 2) and summary["steps"] == 4
    assert [r["step"] for r in rl_rows(run_dir)] == [1, 2, 3, 4]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]  # no partial saves left


def test_sigterm_stops_after_the_step_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", str(ROOT / "examples" / "calculator_tiny.toml"), "--run-dir", str(run_dir), "train.steps=50",
            *SMALL[:-1], "train.checkpoint_every=1000"]
    proc = ctxrl(*args, cwd=tmp_path)
    wait_for_step(run_dir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM after step" in err and "--resume" in err
    done = max(r["step"] for r in rl_rows(run_dir))
    assert done < 50
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")  # written on the stop, although not due
    assert json.loads((latest / "state.json").read_text())["step"] == done


def _mount_namespace() -> bool:
    """Whether this machine lets a test mount file systems of its own (an unprivileged user and mount namespace)."""
    import shutil

    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
@pytest.mark.skipif(not _mount_namespace(), reason="needs unshare -rm (user and mount namespaces)")
def test_a_full_or_read_only_run_directory_is_one_line_naming_the_path_and_how_to_resume(tmp_path):
    """On real file systems of a private mount namespace: a 6 MB tmpfs fills up while the second checkpoint is written,
    then the same directory read-only refuses --resume; each is exit 2, one line naming the path and the newest
    checkpoint. With space again, --resume does as the line says."""
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    run = mnt / "run"
    train_ = f"{sys.executable} -m ctxrl.cli train {ROOT / 'examples' / 'calculator_tiny.toml'} --run-dir {run} " + \
        " ".join([*SMALL, "train.steps=2"])
    script = f"""
        mount -t tmpfs -o size=6m none {mnt}
        {train_} 2> {out}/full.err; echo $? > {out}/full.rc
        mount -o remount,ro {mnt}
        {train_} --resume 2> {out}/ro.err; echo $? > {out}/ro.rc
        mount -o remount,rw,size=64m {mnt}
        {train_} --resume --json > {out}/ok.out 2> {out}/ok.err; echo $? > {out}/ok.rc
        cp {run}/metrics.jsonl {out}/
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # this ctxrl
    subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, env=env, timeout=600, check=True)
    newest = run / "checkpoints" / "step-000000"
    full = (out / "full.err").read_text().strip().splitlines()[-1]
    assert (out / "full.rc").read_text().strip() == "2", full
    assert full == (f"ctxrl: storage error: cannot write {run / 'checkpoints' / 'step-000001'}: No space left on "
                    f"device (the file system is full: free some space). The run stopped; the newest checkpoint is "
                    f"{newest}: once {run} can be written, continue with --run-dir {run} --resume.")
    read_only = (out / "ro.err").read_text().strip().splitlines()[-1]
    assert (out / "ro.rc").read_text().strip() == "2", read_only
    assert read_only.startswith(f"ctxrl: storage error: cannot write {run / 'metrics.jsonl'}: Read-only file system "
                                "(the file system is read-only: mount it read-write or choose another --run-dir)")
    assert f"the newest checkpoint is {newest}" in read_only and f"--run-dir {run} --resume." in read_only
    assert (out / "ok.rc").read_text().strip() == "0", (out / "ok.err").read_text()[-3000:]
    assert json.loads((out / "ok.out").read_text().strip().splitlines()[-1])["resumed_from"] == 0
    assert [r["step"] for r in rl_rows(out)] == [1, 2]


# -- (c) crash mid-save ---------------------------------------------------------------------------
def test_crash_mid_save_leaves_latest_at_the_previous_checkpoint(tmp_path, monkeypatch):
    run = build(config("train.steps=2"), tmp_path)
    start_learning(run)
    rl_step(run, 0)
    checkpoint.save(run, 1)
    rl_step(run, 1)
    real = ckpt.save_state

    def crash(state, directory, name):
        real(state, directory, name)
        if name == "optimizer":
            raise OSError("disk full (injected)")

    monkeypatch.setattr("ctxrl.train.checkpoint.save_state", crash)
    with pytest.raises(OSError, match="injected"):
        checkpoint.save(run, 2)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-000001"
    assert not (root / "step-000002").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    ckpt.latest_checkpoint(root)  # complete


def test_killed_save_leaves_only_a_hidden_temporary_that_resume_removes(tmp_path):
    train(config("train.steps=1"), tmp_path)
    root = tmp_path / "checkpoints"
    (root / ".step-000002-abcd").mkdir()  # what a SIGKILL during a save leaves behind
    (root / ".step-000002-abcd" / "model.safetensors").write_bytes(b"partial")
    train(config("train.steps=2"), tmp_path, resume=True)
    assert not (root / ".step-000002-abcd").exists()
    assert (root / "latest").read_text().strip() == "step-000002"


# -- (d) NaN guards -------------------------------------------------------------------------------
def test_nan_skips_the_update_with_weights_and_optimizer_untouched(tmp_path):
    run = build(config("train.steps=2"), tmp_path)
    learner = start_learning(run)
    rl_step(run, 0)  # the optimiser now has state
    params = {k: v.detach().clone() for k, v in run.model.named_parameters()}
    opt = {k: {n: t.clone() for n, t in s.items()} for k, s in learner.optimizer.state_dict()["state"].items()}
    episodes = run.collector.rollout_round(1, 0)
    metrics = learner.update(learner.collate([TrainSequence.of(e, [float("nan")] * len(e.input_ids))
                                              for e in episodes]))
    assert metrics["skipped"] == 1.0 and learner.skipped_updates == 2  # 2 mini-batches
    assert all(torch.equal(params[k], v) for k, v in run.model.named_parameters())
    after = learner.optimizer.state_dict()["state"]
    assert all(torch.equal(opt[k][n], after[k][n]) for k in opt for n in opt[k])


def test_consecutive_skips_abort_and_point_at_the_checkpoint(tmp_path, monkeypatch):
    def nan_advantages(self, episodes, **kw):
        return [[TrainSequence.of(e, [float("nan")] * len(e.input_ids))] for e in episodes]

    train(config("train.steps=1"), tmp_path)
    monkeypatch.setattr(GRPO, "estimate", nan_advantages)
    with pytest.raises(TrainingAborted) as info:
        train(config("train.steps=10", "train.max_consecutive_skips=2"), tmp_path, resume=True)
    message = str(info.value)
    # step-000002 was written one skipped step into the streak: the last good one is step-000001
    assert "2 RL steps in a row" in message and "last good checkpoint is" in message
    assert message.split("last good checkpoint is ")[1].split(":")[0].endswith("step-000001")
    assert "--resume" in message
    rows = rl_rows(tmp_path)
    assert [r["skipped"] for r in rows[1:]] == [1.0, 1.0] and rows[-1]["skipped_updates_total"] == 4.0


def test_an_update_that_leaves_non_finite_weights_stops_the_run_before_they_are_saved(tmp_path, learning_signal,
                                                                                    monkeypatch, capsys):
    """A finite loss and gradient norm, then weights that are not numbers (as float16 rounding of a too-large master
    gives): the run stops at that step, exit 3, one line naming it and the last good checkpoint."""
    from ctxrl.cli import main
    from ctxrl.train.learner import Learner

    real, updates = Learner.update, []

    def update(self, batch):
        metrics = real(self, batch)
        updates.append(metrics)
        if len(updates) == 2:  # step 2's update
            with torch.no_grad():
                self.model.get_input_embeddings().weight[3, 0] = float("inf")
        return metrics

    monkeypatch.setattr(Learner, "update", update)
    code = main(["train", str(ROOT / "examples" / "calculator_tiny.toml"), "--run-dir", str(tmp_path), *SMALL,
                 "train.steps=3"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 3 and err.startswith("ctxrl: run aborted: step 2: the update left NaN or infinite values in 1 "
                                        "trained tensors (model.embed_tokens.weight)"), err
    assert "train.lr=0.0001" in err and f"last good checkpoint is {tmp_path / 'checkpoints' / 'step-000001'}" in err
    assert "--resume" in err and len(updates) == 2
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-000001"
    assert not (root / "step-000002").exists() and not (root / "final").exists()
    assert [r["step"] for r in rl_rows(tmp_path)] == [1]  # step 2's row was never logged


def test_non_finite_weights_are_never_saved_and_nan_log_probs_stop_the_step(tmp_path):
    run = build(config("train.steps=2", "sft.enabled=false"), tmp_path)
    start_learning(run)
    checkpoint.save(run, 0)
    with torch.no_grad():
        weight = run.model.get_input_embeddings().weight
        saved, weight[0, 0] = float(weight[0, 0]), float("nan")
    with pytest.raises(CheckpointError, match=r"refusing to save checkpoints/step-000001: 1 trained tensors hold NaN "
                                              r"or infinite values \(model.embed_tokens.weight\)\. The last good "
                                              r"checkpoint is .*step-000000"):
        checkpoint.save(run, 1)
    with pytest.raises(CheckpointError, match="refusing to save checkpoints/final"):
        loop.save_final(run, "final")
    assert not (tmp_path / "checkpoints" / "step-000001").exists() and not (tmp_path / "checkpoints" / "final").exists()
    with torch.no_grad():
        weight[0, 0] = saved
    real = run.collector.collect

    def collect(step):  # the engine's policy gives NaN log-probs (finite weights too large to give numbers)
        got = real(step)
        for e in got.episodes:
            e.behavior_logprobs = [float("nan") if m else 0.0 for m in e.loss_mask]
        return got

    run.collector.collect = collect  # (the step's collect phase asks the run's Collector)
    with pytest.raises(TrainingAborted, match=r"step 1: the policy \(version 0\) sampled 4 of 4 episodes with NaN "
                                              r"log-probabilities.*last good checkpoint is .*step-000000"):
        rl_step(run, 0)


# -- (e) hanging and crashing environments -------------------------------------------------------
@register("flaky_calculator")
class FlakyCalculatorEnv(CalculatorEnv):
    """Calculator tasks whose set-up crashes for one task and hangs for another."""

    name = "flaky_calculator"

    def reset(self, task, *, seed=None):
        if task.prompt == self.crash_prompt():
            raise RuntimeError("environment crashed (injected)")
        if task.prompt == self.hang_prompt():
            time.sleep(20)  # a set-up that hangs: bound by the episode deadline (2 s here)
        return super().reset(task, seed=seed)

    @classmethod
    def crash_prompt(cls):
        return cls.sample_tasks("train", 1, 7)[0].prompt

    @classmethod
    def hang_prompt(cls):
        return cls.sample_tasks("train", 2, 7)[1].prompt

    @classmethod
    def sample_tasks(cls, split, n, seed):
        if split == "train":
            fixed = CalculatorEnv.sample_tasks("train", 4, 7)
            return fixed[:n] if n <= 4 else CalculatorEnv.sample_tasks(split, n, seed)
        return CalculatorEnv.sample_tasks(split, n, seed)


def test_crashing_env_and_hanging_episode_are_errored_excluded_and_counted(tmp_path):
    cfg = config("env.name=flaky_calculator", "rollout.tasks_per_step=4", "rollout.episode_timeout_s=2",
                 "rollout.max_error_rate=0.6", "sft.enabled=false")
    from ctxrl.report.progress import LineProgress

    console = io.StringIO()
    run = build(cfg, tmp_path, progress=LineProgress(console))
    start_learning(run)
    started = time.monotonic()
    row = rl_step(run, 0)
    # said on the console as it happens, not only counted in the metrics
    assert re.search(r"^step 1: 4 of 8 episodes errored: (environment reset|deadline)", console.getvalue(), re.M)
    assert time.monotonic() - started < 15  # the hang was cut at its deadline, and nothing waited for it
    assert row["errored_episodes"] == 4 and row["deadline_episodes"] == 2
    assert (row["errors_reset"], row["errors_deadline"], row["errors_step"], row["errors_constructor"]) == (2, 2, 0, 0)
    # what the deadline dropped is logged next to what was kept (here: a reset that hung, so nothing sampled)
    assert row["deadline_dropped_tokens_mean"] == 0.0 and row["kept_tokens_mean"] > 0
    assert row["episodes_dropped_small_groups"] == 0 and row["trained_episodes"] == 4  # two whole groups errored
    run.writer.close()
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    errored = [s for s in samples if s["phase"] == "rl-errored"]
    assert len(errored) == 4
    assert sorted(s["error_kind"] for s in errored) == ["deadline", "deadline", "reset", "reset"]
    assert sorted(s["error"].split(":")[0] for s in errored) == ["deadline", "deadline", "environment reset",
                                                                "environment reset"]
    assert all("RuntimeError: environment crashed" in s["error"] for s in errored if s["error_kind"] == "reset")


def test_error_rate_threshold_aborts(tmp_path):
    cfg = config("env.name=flaky_calculator", "rollout.tasks_per_step=4", "rollout.episode_timeout_s=2",
                 "rollout.max_error_rate=0.25", "sft.enabled=false")
    run = build(cfg, tmp_path)
    start_learning(run)
    with pytest.raises(TrainingAborted, match="4 of 8 episodes errored"):
        rl_step(run, 0)


def test_a_group_left_with_one_valid_episode_is_dropped():
    from ctxrl.train.trainer import drop_small_groups
    from ctxrl.types import Episode, Task

    task = Task(id="t", prompt="p", answer="a")
    eps = [Episode(task=task, group_id=g) for g in (0, 0, 1, 1, 2)]
    kept, dropped = drop_small_groups(eps[:3] + eps[4:])
    assert [e.group_id for e in kept] == [0, 0] and dropped == 2  # one episode each of groups 1 and 2


# -- (f) bad input ---------------------------------------------------------------------------------
def test_bad_input_messages(tmp_path, tiny_path):
    from ctxrl.envs.jsonl_tools import load_tasks
    from ctxrl.models.loader import ModelLoadError, resolve

    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)
    with pytest.raises(ConfigError, match="train.stepz; did you mean 'train.steps'"):
        load_config(None, ["train.stepz=3"])
    with pytest.raises(ConfigError, match="rollout.max_error_rate must be in"):
        load_config(None, ["rollout.max_error_rate=2"])
    with pytest.raises(ConfigError, match="train.max_consecutive_skips must be > 0"):
        load_config(None, ["train.max_consecutive_skips=0"])
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"}\n')
    with pytest.raises(Exception, match=r'tasks.jsonl:2: the task has no "answer"'):
        load_tasks(str(data))
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="weights"):
        resolve(str(empty))


# -- (g) missing pieces, config changes; (h) no pickle ---------------------------------------------
def test_resume_with_missing_optimizer_or_changed_config_raises(tmp_path):
    train(config("train.steps=1"), tmp_path)
    with pytest.raises(CheckpointError, match=r"algo.clip_low: 0.2 -> 0.3"):
        train(config("train.steps=2", "algo.clip_low=0.3"), tmp_path, resume=True)
    (tmp_path / "checkpoints" / "step-000001" / "optimizer.safetensors").unlink()
    with pytest.raises(CheckpointError, match="optimizer.safetensors missing"):
        train(config("train.steps=2"), tmp_path, resume=True)
    with pytest.raises(CheckpointError, match="holds no run"):
        train(config("train.steps=2"), tmp_path / "fresh", resume=True)


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_previous_one(tmp_path, capsys, learning_signal):
    """Checksums: 64 KiB overwritten in the middle of the weights (which would load, as garbage) or a file cut short
    is one line naming the file, offering the previous checkpoint; following the offer resumes."""
    import shutil

    from ctxrl.cli import main

    base = tmp_path / "base"
    train(config("train.steps=2"), base)
    checksums = json.loads((base / "checkpoints" / "step-000002" / ckpt.CHECKSUMS).read_text())["sha256"]
    assert {"model.safetensors", "optimizer.safetensors", "state.json", "config.toml"} <= set(checksums)
    assert (base / "checkpoints" / "step-000002" / "optimizer.safetensors").stat().st_size > 100_000  # (Adam's moments)

    def copy(name: str) -> Path:
        shutil.copytree(base, tmp_path / name)
        return tmp_path / name

    overwritten = copy("overwritten")
    weights = overwritten / "checkpoints" / "step-000002" / "model.safetensors"
    size = weights.stat().st_size
    assert size > 256 * 1024
    with open(weights, "r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(64 * 1024))
    with pytest.raises(CheckpointError) as info:
        train(config("train.steps=3"), overwritten, resume=True)
    message = str(info.value)
    assert message.startswith(f"checkpoint {weights.parent} is damaged: model.safetensors does not match the "
                              "checksum it was written with"), message
    previous = overwritten / "checkpoints" / "step-000001"
    assert f"The previous checkpoint is {previous}" in message and "echo step-000001 > " in message
    (overwritten / "checkpoints" / "latest").write_text("step-000001\n")  # as the message says
    assert train(config("train.steps=3"), overwritten, resume=True)["resumed_from"] == 1
    assert [r["step"] for r in rl_rows(overwritten)] == [1, 2, 3]

    truncated = copy("truncated")  # cut short, from the command line: one line, exit 2
    optimizer = truncated / "checkpoints" / "step-000002" / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    args = ["train", str(ROOT / "examples" / "calculator_tiny.toml"), "--run-dir", str(truncated), *SMALL,
            "train.steps=3", "--resume"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ctxrl: checkpoint error: checkpoint " in err, err
    assert "optimizer.safetensors does not match" in err and "step-000001" in err

    def written_before_checksums(name: str) -> Path:
        run = copy(name)
        for path in (run / "checkpoints").glob("step-*"):
            (path / ckpt.CHECKSUMS).unlink()
        return run

    # written before checksums: loads with a note, and a file cut short is still one clear error
    with pytest.warns(UserWarning, match="has no checksums.json"):
        assert train(config("train.steps=3"), written_before_checksums("old-intact"), resume=True)["resumed_from"] == 2
    old = written_before_checksums("old")
    optimizer = old / "checkpoints" / "step-000002" / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"step-000002 is damaged: optimizer.safetensors cannot be read "
                                              r"\(Error while deserializing header.*previous checkpoint is"):
        train(config("train.steps=3"), old, resume=True)

    # checksums that match say the files are as written, not that what was written was good (issue 51)
    from safetensors.torch import load_file, save_file

    from ctxrl.train.checkpoint import finite_weights, resume_hint
    from ctxrl.train.checkpoint_io import write_checksums

    negative = copy("negative-step")
    state_path = negative / "checkpoints" / "step-000002" / "state.json"
    state_path.write_text(json.dumps({**json.loads(state_path.read_text()), "step": -5}))
    write_checksums(state_path.parent)
    with pytest.raises(CheckpointError, match=r"state.json says step = -5, which is no count of steps"):
        train(config("train.steps=3"), negative, resume=True)
    poisoned = copy("nan-weights")
    weights = poisoned / "checkpoints" / "step-000002" / "model.safetensors"
    tensors = load_file(str(weights))
    first = next(iter(tensors))
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, str(weights))
    write_checksums(weights.parent)
    assert not finite_weights(weights.parent) and finite_weights(poisoned / "checkpoints" / "step-000001")
    assert "last good checkpoint is " + str(poisoned / "checkpoints" / "step-000001") in resume_hint(poisoned, 1)


def test_resume_never_unpickles(tmp_path, monkeypatch):
    train(config("train.steps=1"), tmp_path)

    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint load called pickle")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    summary = train(config("train.steps=2"), tmp_path, resume=True)
    assert summary["resumed_from"] == 1


def test_a_raising_constructor_is_an_errored_episode_too(renderer):
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.rollout.agent import run_episodes
    from ctxrl.rollout.spec import RolloutLimits

    def broken():
        raise OSError("no such dataset (injected)")

    tasks = CalculatorEnv.sample_tasks("train", 2, 0)
    episodes = asyncio.run(run_episodes(broken, tasks, ScriptedEngine(["<answer>1</answer>"], renderer), renderer,
                                        RolloutLimits(timeout_s=5), group_size=2))
    assert len(episodes) == 4 and all(e.truncation == "error" for e in episodes)
    assert all(e.info["error_kind"] == "constructor" and "no such dataset" in e.info["error"] for e in episodes)


def test_a_failure_in_ctxrl_or_the_engine_stops_the_run_and_names_the_newest_checkpoint(tmp_path, renderer,
                                                                                        monkeypatch):
    """Not an errored episode: an exception outside the environment propagates, with where to resume from."""
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.rollout.agent import run_episodes
    from ctxrl.rollout.spec import RolloutLimits

    class BrokenEngine(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    tasks = CalculatorEnv.sample_tasks("train", 2, 0)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        asyncio.run(run_episodes(CalculatorEnv, tasks, BrokenEngine([], renderer), renderer, RolloutLimits(),
                                 group_size=2))
    import ctxrl.run.step as step_module

    run = build(config("train.steps=3"), tmp_path)
    real = step_module.rl_step

    def step(run, i):
        if i == 1:
            run.worker.engine = BrokenEngine([], renderer)
        return real(run, i)

    monkeypatch.setattr(step_module, "rl_step", step)  # (the loop looks the step up there when it runs)
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        loop.fit(run)
    note = "".join(getattr(info.value, "__notes__", []))
    assert "RL step 2 failed; the newest checkpoint is" in note and "step-000001" in note and "--resume" in note
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1]  # nothing of step 2 was logged as if it had run


# -- review follow-ups ------------------------------------------------------------------------------
@pytest.mark.slow  # (16 s: three runs; the resume tests above keep resume in the default run)
def test_resume_twice_after_changing_what_is_logged(tmp_path):
    """Log offsets are measured from the files, so a checkpoint taken after a rewind is right."""
    train(config("train.steps=2"), tmp_path)
    train(config("train.steps=3", "run.samples_per_step=0"), tmp_path, resume=True)
    train(config("train.steps=4", "run.samples_per_step=0"), tmp_path, resume=True)
    assert [r["step"] for r in rl_rows(tmp_path)] == [1, 2, 3, 4]


def test_rewriting_the_latest_step_never_leaves_latest_dangling(tmp_path):
    root = tmp_path / "checkpoints"

    def write(text):
        def go(d):
            for name in (*ckpt.REQUIRED, "model.safetensors"):
                (d / name).write_text(text)
        return go

    ckpt.commit_checkpoint(root, "step-000001", write("old"))
    with pytest.raises(OSError):
        ckpt.commit_checkpoint(root, "step-000001", lambda d: (_ for _ in ()).throw(OSError("injected")))
    assert (ckpt.latest_checkpoint(root) / "state.json").read_text() == "old"
    ckpt.commit_checkpoint(root, "step-000001", write("new"))
    assert (ckpt.latest_checkpoint(root) / "state.json").read_text() == "new"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert oct((root / "step-000001").stat().st_mode & 0o777) == "0o755"


def test_warm_start_is_checkpointed_and_steps_below_the_checkpoint_are_refused(tmp_path):
    train(config("train.steps=2"), tmp_path)
    assert (tmp_path / "checkpoints" / "step-000000").is_dir()  # resumable right after the warm start
    with pytest.raises(CheckpointError, match="beyond train.steps=1"):
        train(config("train.steps=1"), tmp_path, resume=True)


def test_a_new_run_refuses_a_directory_that_holds_one(tmp_path):
    train(config("train.steps=1"), tmp_path)
    with pytest.raises(CheckpointError, match="already holds a run.*--resume"):
        train(config("train.steps=1"), tmp_path)


def test_a_batch_without_learning_signal_leaves_weights_and_optimizer_untouched(tmp_path):
    """All advantages 0: no optimiser step, so Adam's momentum from earlier steps does not move the weights."""
    run = build(config("train.steps=2"), tmp_path)
    learner = start_learning(run)
    rl_step(run, 0)
    params = {k: v.detach().clone() for k, v in run.model.named_parameters()}
    opt = {k: {n: t.clone() for n, t in s.items()} for k, s in learner.optimizer.state_dict()["state"].items()}
    episodes = run.collector.rollout_round(1, 0)
    metrics = learner.update(learner.collate([TrainSequence.of(e, [0.0] * len(e.input_ids)) for e in episodes]))
    assert metrics["no_signal"] == 1.0 and metrics["skipped"] == 0.0
    assert all(torch.equal(params[k], v) for k, v in run.model.named_parameters())
    after = learner.optimizer.state_dict()["state"]
    assert all(torch.equal(opt[k][n], after[k][n]) for k in opt for n in opt[k])
