"""The trainer: a warm start, then RL steps of collect -> filter -> estimate -> update -> log, with evaluations.

One RL step, as named phases (each a short method below):

1. **collect**: sample ``rollout.tasks_per_step`` training tasks (the curriculum's) and play
   ``rollout.group_size`` episodes of each (trials of attempts with ``meta.num_attempts > 1``) with
   the rollout worker; DAPO dynamic sampling plays more rounds until enough groups are informative;
2. **filter**: errored episodes are logged and left out (too many abort the run); groups left with
   fewer than two valid episodes are dropped when the estimator needs groups;
3. **estimate**: the configured estimator (``algo.advantage``, a registered object) turns episodes
   into training rows with per-token advantages (a KL penalty in the reward and the critic's
   values first, when configured); SimpleTIR's void-turn filter drops episodes after the group
   statistics;
4. **update**: ``ppo_epochs`` x ``mini_batches`` PPO updates on the collated rows, then the new
   weights go to the worker's engine (its own copy) with the next policy version;
5. **log**: one metrics row, sample episodes, and the abort on too many skipped updates.

``fit`` is the outer loop: warm start, evaluation, the steps with evaluations and checkpoints at
their cadence, a graceful stop on SIGINT/SIGTERM, the final evaluation and checkpoint. What the
default "GRPO" is: group-normalised outcome advantages (Bessel std), a PPO-clip surrogate with the
behaviour log-probs as the old policy, token-mean aggregation, optional k1/k2/k3 KL to the
warm-start policy (off by default), no value function (docs/algorithms.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ctxrl.algo.estimators import EstimatorSettings, get_estimator
from ctxrl.algo.filters import informative_groups, void_turn_free
from ctxrl.config import Config, to_toml
from ctxrl.envs.hooks import available_splits
from ctxrl.errors import CheckpointError, ConfigError, CtxrlError
from ctxrl.eval.evaluate import evaluate_split
from ctxrl.report.progress import Progress
from ctxrl.report.sinks import make_sinks
from ctxrl.report.writer import RunWriter
from ctxrl.rollout.managers import get_manager
from ctxrl.rollout.managers.stats import context_stats, scheduled_budget
from ctxrl.rollout.spec import RolloutRequest, RolloutSpec, spec_engine
from ctxrl.rollout.summary import summarize
from ctxrl.rollout.worker import RolloutWorker, build_demo_pool, spec_env_class, spec_renderer
from ctxrl.seeds import Seeds
from ctxrl.tasks.curriculum import make_curriculum
from ctxrl.train import checkpoint
from ctxrl.train.learner import Learner, PPOSettings
from ctxrl.train.memory import MemoryPlan, with_learner_tokens
from ctxrl.train.policy import Policy, Reference, export_merged
from ctxrl.train.rewards import shape_rewards
from ctxrl.train.warm_start import check_demos, check_demos_fit, context_demos, warm_start
from ctxrl.types import SPLITS, Episode, TrainSequence

log = logging.getLogger(__name__)


class TrainingAborted(RuntimeError):
    """The run stopped itself (too many skipped updates, too many errored episodes); the message says why."""


class RunStopped(Exception):
    """The run stopped early on a signal, resumably; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Collected:
    """What a step's rollout gave: every episode played, the ones chosen to train on, and its figures."""

    episodes: list[Episode]
    train: list[Episode]
    metrics: dict[str, Any] = field(default_factory=dict)


class Trainer:
    """Everything a run holds (see the module docstring); ``fit`` runs it.

    ``policy`` is the learner's trainable policy (``ctxrl.train.policy``: full or LoRA, its precision)
    and ``model`` its module; the worker's engine samples with its own copy, updated after every
    optimiser step (``sync_engine``). The learner, its reference and critic are built by
    ``make_learner`` when RL starts.
    """

    def __init__(self, config: Config, run_dir: str | Path, *, progress: Progress | None = None,
                 parallel=None) -> None:

        self.config = config
        self.seeds = Seeds(config.run.seed)
        self.progress = progress or Progress()
        seed_everything(config.run.seed)
        self.spec = RolloutSpec.from_config(config)
        self.device = self.spec.model.device
        self.env_cls = spec_env_class(self.spec)
        self.splits = available_splits(self.env_cls)
        if "train" not in self.splits:
            raise ConfigError(f"environment {config.env.name!r} has no 'train' tasks (it has {list(self.splits)}); "
                              "training needs some: label tasks \"split\": \"train\" or leave them unlabelled")
        self.context_demos = context_demos(config, self.env_cls)
        check_demos(config, self.env_cls)
        self.renderer = spec_renderer(self.spec)
        self.tokenizer = self.renderer.tokenizer
        check_before_load(config, self.spec, self.env_cls, self.renderer, under_manager=self.context_demos)
        demo_pool = build_demo_pool(self.spec, self.env_cls, self.renderer)  # a missing demo file stops the run now
        # On CUDA: the memory plan, before anything large is allocated (a run that cannot fit stops here)
        critic = get_estimator(config.algo.advantage).needs_critic
        self.memory = memory_plan(config, self.device, engine=(parallel is None or parallel.leader)
                                  and config.distributed.backend == "none", critic=critic)
        if self.memory is not None:
            self.progress.message(self.memory.summary())
            self.config = with_learner_tokens(config, self.memory)  # (config.toml keeps the user's value)
        else:
            self.config = bounded_micro_batches(config, self.device, self.progress, critic=critic)
        self.policy = Policy.load(config, self.device)
        self.model = self.policy.model
        self.parallel = parallel
        """Data-parallel learner ranks (``torchrun``): rank 0 (the leader) does everything else; the others only
        take the leader's rows and update with it (``ctxrl.distributed.data_parallel``)."""
        self.leader = parallel is None or parallel.leader
        d = config.distributed
        if not self.leader:  # a follower: no engine, no run directory
            self.worker = None
        elif d.backend == "ray":  # rollout actors, each loading the model itself; the weights follow by load_weights
            from ctxrl.distributed.pool import RayRolloutPool

            self.worker = RayRolloutPool(self.spec, workers=d.rollout_workers, address=d.address or None,
                                         timeout_s=d.timeout_s)
        else:
            sizes = {} if self.memory is None else {"max_batch_size": self.memory.kv_slots,
                                                     "prefill_tokens": self.memory.prefill_tokens}
            engine = spec_engine(self.spec, self.policy.engine_model(), self.renderer, **sizes)
            self.worker = RolloutWorker(self.spec, engine, self.renderer, self.env_cls, demo_pool=demo_pool)
        self._prefetched: tuple[int, Any] | None = None  # (step, submitted request): asynchronous rollouts
        self.writer = None
        if self.leader:
            self.writer = RunWriter(run_dir, sinks=make_sinks(config.report, Path(run_dir), name=config.run.name,
                                                              config=config.to_dict()))
            self.writer.write_config(to_toml(config))
        self._skipped_reported = False
        self.curriculum = make_curriculum(config.curriculum)
        self.estimator = get_estimator(config.algo.advantage)(estimator_settings(config))
        self.manager = get_manager(config.context.manager)
        self.learner: Learner | None = None
        self.consecutive_skips = 0

    def decode(self, ids: list[int]) -> str:
        return self.renderer.decode(ids)

    def close(self) -> None:
        """Stop the rollout workers that live outside this process (Ray actors); in-process ones need nothing."""
        close = getattr(self.worker, "close", None)
        if close is not None and self.config.distributed.backend != "none":
            close()

    def sync_engine(self, version: int) -> None:
        """Hand the policy's current weights (LoRA: its adapters) to the worker's engine, as policy ``version``."""
        state, partial = self.policy.engine_state()
        if self.config.distributed.max_staleness > 0:  # the actors take it after what they are playing now
            self.worker.load_weights(state, version=version, partial=partial, wait=False)
        else:
            self.worker.load_weights(state, version=version, partial=partial)

    # -- the outer loop --------------------------------------------------------------------------------
    def fit(self, *, resume: bool = False) -> dict[str, Any]:
        """Warm start (if enabled), evaluate, RL, evaluate again; returns the summary.

        ``resume``: continue from ``checkpoints/latest`` instead (no warm start; the evaluation
        before RL is read back from ``metrics.jsonl``). RL checkpoints are written every
        ``train.checkpoint_every`` steps and when a signal stops the run.
        """
        if not self.leader:
            return self.follow()
        try:
            return self._fit(resume)
        finally:
            self._release_followers()  # (nothing to do in one process)

    def _fit(self, resume: bool) -> dict[str, Any]:
        config, run_dir = self.config, self.writer.dir
        started = time.perf_counter()
        self.progress.message(f"[bold]ctxrl[/bold] run dir {run_dir} | model {config.model.name} on {self.device} | "
                              f"env {config.env.name}" + (" | resuming" if resume else ""))
        every = config.train.checkpoint_every
        summary: dict[str, Any] = {"run_dir": str(run_dir)}
        with GracefulStop() as stop:
            if resume:
                first, before = self._resume()
            else:
                if config.sft.enabled:
                    summary["sft_loss_last"] = self.warm_start()["sft_loss_last"]
                before = self.evaluate(0)
                self._start_followers()
                self.make_learner()
                first = 0
                if every:  # the warm start is expensive: resumable from here on
                    checkpoint.save(self, 0)
            if self.memory is not None:  # what each run records of its plan (benchmarks/shared_gpu.py reads it)
                self.writer.log_metrics({"phase": "memory", "step": first, **self.memory.figures()})
            self.progress.message(("after warm start: " if config.sft.enabled else "before RL: ") + "  ".join(
                f"{split} {before[split]['success']:.2f}" for split in ("heldout", "ood") if split in before))
            steps = config.train.steps
            self.progress.rl_start(f"RL ({config.algo.advantage}, {config.algo.loss})", steps, first)
            done = first
            for step in range(first, steps):
                if stop.signal is not None:
                    break
                try:
                    row = self.step(step)
                except (TrainingAborted, CtxrlError):
                    raise
                except Exception as exc:  # a ctxrl, engine or learner failure: stop with its traceback
                    _add_note(exc, self._crash_note(step))
                    raise
                done = step + 1
                info = (f"reward {row['reward']:.2f} success {row['success']:.2f} tools/ep {row['tool_calls']:.2f} "
                        f"{row['time_step']:.1f}s/step")
                if config.train.eval_every and done % config.train.eval_every == 0 and done < steps:
                    for split, result in self.evaluate(done, splits=("heldout",)).items():
                        info += f" | {split} {result['success']:.2f}"
                if every and done % every == 0:
                    checkpoint.save(self, done)
                self.progress.rl_step(info)
            if stop.signal is not None and done < steps:
                self._stopped(stop.signal, done, first)
            after = self.evaluate(steps) if steps else before
        final = self.save_final("final")
        self.writer.close()
        self.close()
        from ctxrl.report.plots import plot_run

        plots = plot_run(run_dir)
        summary.update(_summary(before, after))
        summary.update({"steps": steps, "resumed_from": first if resume else None,
                        "skipped_updates": self.learner.skipped_updates, "checkpoint": str(final),
                        "plots": [str(p) for p in plots], "device": self.device,
                        "wall_seconds": round(time.perf_counter() - started, 1)})
        return summary

    # -- data-parallel ranks ---------------------------------------------------------------------------
    def _start_followers(self) -> None:
        """Tell the follower ranks RL starts, and give them the (warm-started) weights."""
        if self.parallel is not None:
            scaler = self.policy.precision.scaler  # (the warm start may have moved the loss scale: rank 0's holds)
            self.parallel.broadcast_object(("start", None if scaler is None else scaler.state_dict()))
            self.parallel.broadcast_module(self.model)

    def _release_followers(self) -> None:
        """Tell the follower ranks the run is over (also when it failed: they would otherwise wait)."""
        if self.parallel is not None and not getattr(self, "_followers_released", False):
            self._followers_released = True
            try:
                self.parallel.broadcast_object(("stop", None))
            except Exception as exc:  # noqa: BLE001 - never hide the error that ended the run
                log.warning("could not tell the follower ranks to stop (%s); torchrun ends them with this rank", exc)

    def follow(self) -> dict[str, Any]:
        """A follower rank's run: take the leader's weights, then update on the leader's rows until told to stop."""
        kind, scaler_state = self.parallel.broadcast_object()
        updates = 0
        if kind == "start":
            if scaler_state is not None:
                self.policy.precision.scaler.load_state_dict(scaler_state)
            self.parallel.broadcast_module(self.model)
            self.make_learner()
            while True:
                kind, rows = self.parallel.broadcast_object()
                if kind != "update":
                    break
                if rows:
                    self.learner.update(self.learner.collate(rows))
                updates += 1
        return {"follower": True, "rank": self.parallel.rank, "updates": updates}

    def _resume(self) -> tuple[int, dict[str, dict[str, float]]]:
        self.make_learner()
        first = checkpoint.resume(self)
        before = logged_eval(self.writer.dir, 0)
        if not before:
            raise CheckpointError(f"{self.writer.dir}/metrics.jsonl has no evaluation of step 0; the log does not "
                                  "belong to this checkpoint")
        if first > self.config.train.steps:
            raise CheckpointError(f"the checkpoint is after step {first}, beyond "
                                  f"train.steps={self.config.train.steps}; set train.steps >= {first}")
        self.progress.message(f"resumed from {self.writer.dir / 'checkpoints' / 'latest'} after step {first}")
        return first, before

    def _crash_note(self, step: int) -> str:
        """Where to go on from after a failure in RL step ``step`` (0-based)."""
        root = self.writer.dir / "checkpoints"
        latest = root / "latest"
        if latest.exists():
            return (f"ctxrl: RL step {step + 1} failed; the newest checkpoint is {root / latest.read_text().strip()}: "
                    f"after fixing the cause, continue with --run-dir {self.writer.dir} --resume")
        return (f"ctxrl: RL step {step + 1} failed; no checkpoint was written (train.checkpoint_every="
                f"{self.config.train.checkpoint_every}), so the run cannot be resumed")

    def _stopped(self, signum: int, done: int, first: int) -> None:
        every, run_dir = self.config.train.checkpoint_every, self.writer.dir
        if every:
            if done % every and done > first:  # (done == first: latest already holds this state)
                checkpoint.save(self, done)
            hint = f"resume with --run-dir {run_dir} --resume"
        else:
            hint = "no checkpoint was written (train.checkpoint_every=0), so it cannot be resumed"
        self.writer.close()
        self.close()
        raise RunStopped(f"stopped by {signal.Signals(signum).name} after step {done} of {self.config.train.steps}; "
                         f"{hint}", 128 + signum)

    # -- phases of a run -------------------------------------------------------------------------------
    def warm_start(self, on_step=None) -> dict[str, Any]:
        """Supervised warm start of the policy (``[sft]``); the engine gets the result as policy version 0.

        ``on_step(step, total, loss)`` after each optimiser step (default: the progress display).
        """
        row, demos = warm_start(self.config, self.spec, self.env_cls, self.renderer, self.model,
                                under_manager=self.context_demos, on_step=on_step or self.progress.sft,
                                precision=self.policy.precision)
        self.sync_engine(0)
        self.writer.log_metrics(row)
        self.writer.log_samples(0, demos[:2], self.decode, phase="sft")
        return row

    def evaluate(self, step: int, splits: tuple[str, ...] = SPLITS) -> dict[str, dict[str, float]]:
        """Success (and tool use) on ``eval.tasks`` tasks of each split, greedy by default; logged per split.

        A split the environment has no tasks for (``splits()``) is skipped, and said so once.
        """
        missing = [s for s in SPLITS if s not in self.splits]
        if missing and not self._skipped_reported:
            self._skipped_reported = True
            self.progress.message(f"note: environment {self.config.env.name!r} has no {' or '.join(missing)} tasks: "
                                  "evaluation skips " + ("that split" if len(missing) == 1 else "those splits"))
            self.writer.log_metrics({"phase": "note", "step": step, "skipped_splits": missing})
        return evaluate_splits(self.worker, self.config, self.writer, step,
                               tuple(s for s in splits if s in self.splits), self.progress)

    def make_learner(self) -> Learner:
        """The learner over ``policy``: AdamW on what trains, a KL reference (``algo.kl_coef``: a frozen copy, or the
        LoRA base with adapters off), a critic (``needs_critic``)."""
        from ctxrl.train.critic import Critic

        a, t = self.config.algo, self.config.train
        reference = self.policy.reference() if a.kl_coef > 0 else None
        precision = self.policy.precision
        critic = critic_optimizer = None
        if self.estimator.needs_critic:  # the critic starts as a copy of the warm-started policy
            critic = Critic(self.policy.trainable_copy()).train()
            critic_optimizer = precision.optimizer(critic.parameters(), lr=t.critic_lr, weight_decay=t.weight_decay)
        optimizer = precision.optimizer(self.policy.trainable_parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.learner = Learner(self.model, optimizer, PPOSettings.from_config(self.config),
                               pad_token_id=self.tokenizer.pad_token_id, reference=reference,
                               precision=precision, seed=self.seeds.learner, critic=critic,
                               critic_optimizer=critic_optimizer, parallel=self.parallel)
        return self.learner

    def save_final(self, name: str) -> Path:
        """The policy's weights and tokenizer under ``checkpoints/``, for other tools to load.

        Full fine-tuning: an HF checkpoint in ``model.dtype``, in transformers' own layout (which may
        shard or convert to the hub's names; resumable step checkpoints keep the module's names).
        LoRA: the adapters in PEFT's format, and with ``lora.export_merged`` the base with the
        adapters merged in (``NAME-merged``), ready to serve.
        """
        path = self.policy.save(self.writer.dir / "checkpoints" / name, self.tokenizer)
        if self.policy.is_lora and self.config.lora.export_merged:
            export_merged(path, path.with_name(f"{name}-merged"), dtype=self.config.model.dtype)
        return path

    # -- one RL step ---------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, Any]:
        """One RL step (collect -> filter -> estimate -> update -> log); returns its metrics row."""
        if self.learner is None:
            raise RuntimeError("call make_learner() before the first RL step")
        t0 = time.perf_counter()
        collected = self.collect(step)
        t_rollout = time.perf_counter() - t0
        valid = self.filter(step, collected)
        rows, trained_episodes = self.estimate(valid, collected.metrics)
        t1 = time.perf_counter()
        update = self.update(rows, step)
        times = {"time_rollout": t_rollout, "time_update": time.perf_counter() - t1}
        return self.log(step, collected, valid, rows, trained_episodes, update, times, t0)

    def rollout_round(self, step: int, round_: int) -> list[Episode]:
        """One round of ``tasks_per_step`` fresh tasks x ``group_size`` episodes, rewards shaped.

        Round 0 of step ``s`` always draws the same tasks and seeds; later rounds (dynamic
        sampling) draw new ones, and their group ids follow on from the earlier rounds'.
        """
        c = self.config
        episodes = self.worker.run(self.rollout_request(step, round_))
        shape_rewards(episodes, c.reward, max_total_tokens=c.rollout.max_total_tokens)
        return episodes

    def rollout_request(self, step: int, round_: int) -> RolloutRequest:
        c = self.config
        n, g = c.rollout.tasks_per_step, c.rollout.group_size
        tasks = self.curriculum.sample_tasks(self.env_cls, n, self.seeds.tasks(step, round_), step)
        return RolloutRequest(tasks=tasks, group_size=g, seed=self.seeds.rollout(step, round_), phase="train",
                              step=step, first_episode=round_ * n * g, group_offset=round_ * n,
                              max_turns=self.curriculum.max_turns(step, c.env.max_turns),
                              context_budget=self.context_budget(step))

    def asynchronous_round(self, step: int) -> Collected:
        """Step ``step``'s episodes, started during the previous step's update, and the next step's started now.

        The actors play the next step's request with the weights they hold until this step's
        ``load_weights`` reaches them (it queues behind that request), so its episodes are one version
        old: staleness 1. Episodes more than ``distributed.max_staleness`` versions behind the learner's
        are dropped (counted in ``stale_dropped``); the decoupled objective corrects the rest.
        """
        if self._prefetched is not None and self._prefetched[0] == step:
            submitted = self._prefetched[1]
        else:
            submitted = self.worker.submit(self.rollout_request(step, 0))
        self._prefetched = None
        if step + 1 < self.config.train.steps:
            self._prefetched = (step + 1, self.worker.submit(self.rollout_request(step + 1, 0)))
        episodes = self.worker.collect(submitted)
        current, eta = self.worker.policy_version, self.config.distributed.max_staleness
        kept = [e for e in episodes if current - e.policy_version <= eta]
        ages = [current - e.policy_version for e in episodes]
        shape_rewards(kept, self.config.reward, max_total_tokens=self.config.rollout.max_total_tokens)
        return Collected(kept, kept, {"staleness_mean": sum(ages) / max(len(ages), 1),
                                      "staleness_max": float(max(ages, default=0)),
                                      "stale_dropped": float(len(episodes) - len(kept))})

    def context_budget(self, step: int) -> int:
        """The working-context budget of RL step ``step`` (the budget curriculum, if any)."""
        c = self.config.context
        return scheduled_budget(step, final=c.max_context_tokens, start=c.budget_start_tokens, steps=c.budget_steps)

    def collect(self, step: int) -> Collected:
        """Phase 1: play the step's episodes; with dynamic sampling, rounds until enough groups are informative."""
        c = self.config
        if c.distributed.max_staleness > 0:
            return self.asynchronous_round(step)
        if not c.algo.dynamic_sampling:
            episodes = self.rollout_round(step, 0)
            return Collected(episodes, episodes)
        episodes: list[Episode] = []
        kept: list[int] = []
        rounds = 0
        for round_ in range(1 + c.algo.dynamic_sampling_rounds):
            batch = self.rollout_round(step, round_)
            rounds += 1
            episodes += batch
            ok = [e for e in batch if trainable(e)]
            informative = informative_groups([e.reward for e in ok], [e.group_id for e in ok])
            for g in dict.fromkeys(e.group_id for e, keep in zip(ok, informative) if keep):
                if len(kept) < c.rollout.tasks_per_step:
                    kept.append(g)
            if len(kept) >= c.rollout.tasks_per_step:
                break
        chosen = set(kept)
        return Collected(episodes, [e for e in episodes if e.group_id in chosen],
                         {"dynamic_sampling_rounds": rounds, "dynamic_sampling_groups_kept": len(kept),
                          "dynamic_sampling_groups_dropped": rounds * c.rollout.tasks_per_step - len(kept)})

    def filter(self, step: int, collected: Collected) -> list[Episode]:
        """Phase 2: the curriculum sees the step; errored episodes are logged and left out (too many abort);
        groups too small for group statistics are dropped. Returns the episodes to estimate on."""
        c, metrics = self.config, collected.metrics
        episodes = collected.episodes
        metrics.update(self.curriculum.update([e for e in episodes if e.truncation != "error"]))
        metrics["max_turns"] = self.curriculum.max_turns(step, c.env.max_turns)
        if self.manager.keeps_budget(c.context.max_context_tokens):
            metrics["context_budget"] = self.context_budget(step)
        errored = [e for e in episodes if e.truncation == "error"]
        if errored:  # every errored episode is kept, with its reason, whatever samples_per_step says
            self.writer.log_samples(step + 1, errored, self.decode, phase="rl-errored")
        error_rate = len(errored) / max(len(episodes), 1)
        if error_rate > c.rollout.max_error_rate:
            raise TrainingAborted(
                f"step {step + 1}: {len(errored)} of {len(episodes)} episodes errored (rate {error_rate:.2f} > "
                f"rollout.max_error_rate={c.rollout.max_error_rate}); first error: {errored[0].info.get('error')}. "
                f"The episodes are in {self.writer.dir / 'samples.jsonl'} (phase rl-errored)."
                + checkpoint.resume_hint(self.writer.dir, c.train.checkpoint_every))
        valid = [e for e in collected.train if trainable(e)]
        dropped = 0
        if self.estimator.needs_groups:  # group statistics need two valid episodes
            valid, dropped = drop_small_groups(valid)
        metrics.update({"errored_episodes": len(errored), "error_rate": error_rate,
                        "episodes_dropped_small_groups": dropped, **error_stats(episodes)})
        return valid

    def estimate(self, valid: list[Episode], metrics: dict[str, Any]) -> tuple[list[TrainSequence], int]:
        """Phase 3: per-token advantages (after a KL penalty in the reward and the critic's values, if any),
        then the void-turn filter. Returns the training rows and how many episodes they come from."""
        a, c = self.config.algo, self.config
        penalties = values = None
        if a.kl_coef > 0 and a.kl_placement == "reward" and valid:
            penalties, metrics["kl_reward"] = kl_reward_penalties(
                self.learner.reference, valid, self.tokenizer.pad_token_id, coef=a.kl_coef, kind=a.kl_kind,
                settings=self.learner.settings)
        if self.estimator.needs_critic and valid:
            from ctxrl.train.critic import episode_values

            values = episode_values(self.learner.critic, valid, self.tokenizer.pad_token_id,
                                    micro_batch_size=c.train.micro_batch_size,
                                    max_tokens=c.train.max_tokens_per_microbatch)
        policy = self.spec.train.context
        per_episode = self.estimator.estimate(valid, token_rewards=penalties, values=values,
                                              segment_bonus=lambda s: self.manager.segment_bonus(s, policy)
                                              ) if valid else []
        free = void_turn_free(valid)
        metrics["void_turn_rate"] = (1.0 - sum(free) / len(free)) if free else 0.0
        if a.void_turn_filter:
            metrics["void_turn_filtered"] = len(free) - sum(free)
            per_episode = [rows for rows, keep in zip(per_episode, free) if keep]
        return [row for rows in per_episode for row in rows], len(per_episode)

    def update(self, rows: list[TrainSequence], step: int) -> dict[str, float]:
        """Phase 4: PPO updates on the collated rows; the engine gets the new weights as version ``step + 1``."""
        learner = self.learner
        if self.parallel is not None:  # the follower ranks train on their shares of the same rows
            self.parallel.broadcast_object(("update", rows))
        update = learner.update(learner.collate(rows)) if rows else {}
        if update and update.get("skipped", 0.0) >= 1.0:  # every mini-batch update of the step was skipped
            self.consecutive_skips += 1
        elif update:
            self.consecutive_skips = 0
        update["skipped_updates_total"] = float(learner.skipped_updates)
        self.sync_engine(step + 1)
        return update

    def log(self, step: int, collected: Collected, valid: list[Episode], rows: list[TrainSequence],
            trained_episodes: int, update: dict[str, float], times: dict[str, float], t0: float) -> dict[str, Any]:
        """Phase 5: the step's metrics row and samples; abort after too many skipped updates in a row."""
        c, episodes = self.config, collected.episodes
        sampled = [x for r in rows for x, m in zip(r.advantages, r.loss_mask) if m]
        row = {"phase": "rl", "step": step + 1, **summarize(episodes), **_mean_terms(episodes), **collected.metrics,
               **(context_stats(episodes) if self.manager.rewrites_context else {}),
               **(self._trial_stats(episodes) if self.spec.train_meta.num_attempts > 1 else {}),
               **({"demos_per_episode": float(np.mean([e.info.get("demos", 0) for e in episodes]))}
                  if self.spec.demos.max_demos else {}),
               "trained_episodes": trained_episodes, "trained_sequences": len(rows),
               "advantage_abs_mean": float(np.mean(np.abs(sampled))) if sampled else 0.0,
               "advantage_std": float(np.std(sampled)) if sampled else 0.0,
               "zero_variance_groups": _zero_variance_groups(valid),
               **update,
               "tokens": sum(len(s.input_ids) for e in episodes for s in e.sequences()),
               **times, "time_step": time.perf_counter() - t0, **peak_memory(self.device)}
        self.writer.log_metrics(row)
        if c.run.samples_per_step:
            self.writer.log_samples(step + 1, episodes[: c.run.samples_per_step], self.decode, phase="rl")
        if self.consecutive_skips >= c.train.max_consecutive_skips:
            raise TrainingAborted(
                f"{self.consecutive_skips} RL steps in a row had every update skipped (non-finite loss or gradient "
                f"norm; train.max_consecutive_skips={c.train.max_consecutive_skips}). The weights were not touched "
                "by those steps." + checkpoint.resume_hint(self.writer.dir, c.train.checkpoint_every))
        return row

    @staticmethod
    def _trial_stats(episodes: list[Episode]) -> dict[str, float]:
        from ctxrl.meta.metrics import trial_stats

        return trial_stats(episodes)


def train(config: Config, run_dir: str | Path, *, progress: Progress | None = None,
          resume: bool = False) -> dict[str, Any]:
    """Check ``run_dir``, build a ``Trainer`` and ``fit`` it: what ``ctxrl train`` runs."""
    run_dir = Path(run_dir)
    progress = progress or Progress()
    parallel = data_parallel(config, resume)
    try:
        return _train(config, run_dir, progress, resume, parallel)
    finally:
        if parallel is not None:
            parallel.close()


def _train(config: Config, run_dir: Path, progress: Progress, resume: bool, parallel) -> dict[str, Any]:
    problem = None
    if parallel is None or parallel.leader:  # (the followers load what the leader prepared)
        try:
            prepare_model(config.model.name, progress)
            if resume and not (run_dir / "checkpoints").exists():
                raise CheckpointError(f"--resume: {run_dir} holds no run (no checkpoints directory); check --run-dir")
            metrics = run_dir / "metrics.jsonl"
            if not resume and metrics.exists() and metrics.stat().st_size > 0:
                raise CheckpointError(f"{run_dir} already holds a run ({metrics} is not empty); continue it with "
                                      "--resume, or choose another --run-dir: a new run would mix its logs with the "
                                      "old one's")
        except Exception as exc:  # noqa: BLE001 - the followers must hear of any failure, then it is raised here
            problem = exc
    if parallel is not None:
        message = parallel.broadcast_object(None if problem is None else str(problem))
        if message is not None and problem is None:
            raise TrainingAborted(f"rank 0 stopped before training: {message}")
    if problem is not None:
        raise problem
    return Trainer(config, run_dir, progress=progress, parallel=parallel).fit(resume=resume)


def data_parallel(config: Config, resume: bool = False):
    """The learner's data-parallel ranks when ``torchrun`` started this process (``WORLD_SIZE`` > 1), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if config.distributed.backend != "none":
        raise ConfigError("a data-parallel learner (torchrun) runs its rollouts in rank 0's process; it cannot be "
                          f"combined with distributed.backend={config.distributed.backend!r} yet")
    if resume:
        raise ConfigError("--resume under torchrun is not supported yet: resume the run in one process (the "
                          "checkpoint is the same whatever the number of learner ranks)")
    from ctxrl.distributed.data_parallel import DataParallel
    from ctxrl.models.loader import resolve_device

    return DataParallel.from_environment(resolve_device(config.model.device))


def model_shape(config: Config):
    """``(hf_config, ModelShape)`` of ``config``'s model, read from its HF config and a ``meta``-device build (no
    memory), or the reason it cannot be (a LoRA adapter directory, an architecture without the sizes) as a string."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ctxrl.models.loader import resolve
    from ctxrl.train.memory import ModelShape

    try:
        hf = AutoConfig.from_pretrained(resolve(config.model.name))
        with torch.device("meta"):
            parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
        return hf, ModelShape.from_hf_config(hf, parameters)
    except Exception as exc:  # noqa: BLE001 - the caller says what goes unsized
        return str(exc)


def bounded_micro_batches(config: Config, device: str, progress: Progress, *, critic: bool) -> Config:
    """Off CUDA (no memory plan): ``config`` with a token budget per learner micro-batch when
    ``train.micro_batch_size`` rows of ``rollout.max_total_tokens`` would hold more activations than
    ``DEFAULT_ACTIVATION_BYTES`` (4 GiB), said once; otherwise, or with the user's own budget, unchanged.

    A real model on a CPU needs it: SmolLM2-135M keeps about 1.9 MB of float32 activations per token, so 32
    rows of 500 tokens (a summarize warm start's segments) took 24 GB and the kernel killed the run. The tiny
    models never come near the bound, so their micro-batches stay as configured."""
    if torch.device(device).type == "cuda" or config.train.max_tokens_per_microbatch > 0:
        return config
    found = model_shape(config)
    if isinstance(found, str):  # nothing to size it by: the micro-batches stay as configured
        return config
    from ctxrl.train.memory import RunSizes, activation_bytes_per_token, fitting_tokens

    run = RunSizes.from_config(config, found[1], device_bytes=0, engine=False, critic=critic, kv_tokens_per_slot=0)
    per_token = activation_bytes_per_token(run)
    tokens = max(fitting_tokens(run), config.rollout.max_total_tokens)
    if tokens >= config.train.micro_batch_size * config.rollout.max_total_tokens:
        return config
    progress.message(f"learner micro-batches of at most {tokens} tokens ({per_token / 2**20:.2f} MiB of activations "
                     f"per token); train.max_tokens_per_microbatch sets another budget")
    return dataclasses.replace(config, train=dataclasses.replace(config.train, max_tokens_per_microbatch=tokens))


def check_before_load(config: Config, spec: RolloutSpec, env_cls: type, renderer, *, under_manager: bool) -> None:
    """What the tokenizer alone can refuse, before the model loads: a template that splits segments where the run
    needs them whole, and warm-start demos that do not fit the context budget."""
    check_template_segments(config, renderer)
    check_demos_fit(config, spec, env_cls, renderer, under_manager=under_manager)


def memory_plan(config: Config, device: str, *, engine: bool, critic: bool) -> MemoryPlan | None:
    """The run's memory plan on CUDA (``ctxrl.train.memory``), its allocator cap applied; None on the CPU.

    The model's shape comes from its HF config and its parameter count from the model built on the
    ``meta`` device (no memory), so a run that cannot fit stops before its weights are loaded. A plan
    that exceeds what the card has free now is a ``ConfigError`` too. ``engine``: the rollout engine
    lives in this process (not on a follower rank, not in Ray actors).
    """
    if torch.device(device).type != "cuda":
        return None
    from ctxrl.engine.factory import slot_capacity
    from ctxrl.train.memory import RunSizes, check_free, plan_memory

    found = model_shape(config)
    if isinstance(found, str):
        log.warning("no memory plan for %s (%s): the KV pool and micro-batches keep the config's sizes, and "
                    "model.gpu_memory_fraction is not applied", config.model.name, found)
        return None
    hf, shape = found
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index  # (the cap needs one: "cuda" is not)
    free, total = torch.cuda.mem_get_info(index)
    positions = min(config.rollout.max_total_tokens, getattr(hf, "max_position_embeddings", None) or 10**9)
    plan = plan_memory(RunSizes.from_config(config, shape, device_bytes=total, engine=engine, critic=critic,
                                            kv_tokens_per_slot=slot_capacity(positions)))
    check_free(plan, free)
    if plan.capped:
        torch.cuda.set_per_process_memory_fraction(plan.budget_bytes / total, index)
        expandable_segments()
    return plan


def expandable_segments() -> bool:
    """Let torch's allocator grow segments in place (less fragmentation: under a cap it counts against the run,
    ``ctxrl.train.memory.CAPPED_HEADROOM``), unless the user configured the allocator (``PYTORCH_CUDA_ALLOC_CONF``).
    True when it was turned on here."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return False
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return True


def peak_memory(device: str) -> dict[str, float]:
    """``peak_gpu_gib``: the most device memory torch's allocator has reserved so far (what the card sees of it,
    without the CUDA context); nothing on the CPU."""
    if torch.device(device).type != "cuda":
        return {}
    return {"peak_gpu_gib": torch.cuda.max_memory_reserved(torch.device(device)) / 2**30}


def check_template_segments(config: Config, renderer) -> None:
    """Warn when the chat template cuts episodes with user messages into segments that this run cannot train.

    A template that rewrites history at a user message (``ChatRenderer.rewrites_history``) makes
    segments wherever an episode gets one. Trials and context managers are validated for segments
    already (``ctxrl.config``); an environment that replies as the user is not known in advance, so
    this is a warning now rather than a surprise at the first step that meets one.
    """
    from ctxrl.algo.estimators import get_estimator

    estimator = get_estimator(config.algo.advantage)
    problems = []
    if not (estimator.one_per_episode or estimator.credits_attempts):
        problems.append(f"algo.advantage={config.algo.advantage} (needs one advantage per episode)")
    if config.algo.agg != "token-mean":
        problems.append(f"algo.agg={config.algo.agg} (a seq-mean aggregation would count segments)")
    if config.algo.kl_coef > 0 and config.algo.kl_placement == "reward":
        problems.append("algo.kl_placement=reward (the penalty would miss closed segments)")
    if not problems or not renderer.rewrites_history():
        return
    import warnings

    warnings.warn(f"the chat template of {config.model.name!r} rewrites earlier turns once a user message follows "
                  "(docs/tool-formats.md): an episode that gets one trains as segments, which "
                  + " and ".join(problems) + " cannot do, and the run would stop at that step. If the environment "
                  "can reply as the user, use an outcome estimator (grpo, rloo, ...) with algo.agg=token-mean and "
                  "any KL in the loss", stacklevel=2)


def prepare_model(name: str, progress: Progress) -> None:
    """Build the tiny model, or convert a GGUF checkpoint (a named real model's included), now if it is not
    cached yet, showing how far it is (minutes on a CPU for the tiny model, seconds for a GGUF)."""
    from ctxrl.models.cache import cache_root
    from ctxrl.models.loader import parse_tiny, resolve, resolves_to_cache
    from ctxrl.models.tiny import is_built

    if not resolves_to_cache(name):
        return
    spec = parse_tiny(name)
    if spec is not None and not is_built(spec):
        progress.message(f"building the tiny model {name!r} once (a few minutes on a CPU; cached in {cache_root()})")
    resolve(name, on_progress=progress.stage)


def evaluate_splits(worker: RolloutWorker, config: Config, writer: RunWriter, step: int,
                    splits: tuple[str, ...] = SPLITS, progress: Progress | None = None) -> dict[str, dict[str, float]]:
    """Evaluate ``splits`` with ``worker`` and log each (``ctxrl eval`` and the trainer)."""
    results = {}
    trials = config.meta.eval_trials
    for split in splits:
        t0 = time.perf_counter()
        name = f"evaluation (step {step}, {split})"
        summary, episodes = evaluate_split(worker, split, config.eval.tasks, seed=config.eval.seed,
                                           trials_per_task=trials,
                                           on_episode=None if progress is None else
                                           lambda done, total, name=name: progress.stage(name, done, total))
        if any(e.info.get("demos") for e in episodes):
            raise RuntimeError("an evaluation episode was shown demonstrations; evaluation must be zero-shot")
        summary["seconds"] = time.perf_counter() - t0
        if get_manager(config.context.manager).rewrites_context:
            summary.update(context_stats(episodes))
        writer.log_metrics({"phase": "eval", "step": step, "split": split, **summary})
        writer.log_samples(step, episodes[:2], worker.renderer.decode, phase=f"eval-{split}")
        results[split] = summary
    return results


def estimator_settings(config: Config) -> EstimatorSettings:
    a, m = config.algo, config.meta
    return EstimatorSettings(gamma=a.gamma, lam=a.lam, gae_level=a.gae_level, credit=m.credit,
                             gamma_trial=m.gamma_trial, normalize=m.normalize, baseline=m.baseline,
                             num_attempts=m.num_attempts)


@torch.no_grad()
def kl_reward_penalties(reference: Reference, episodes: list[Episode], pad_token_id: int, *, coef: float, kind: str,
                        settings: PPOSettings) -> tuple[list[list[float]], float]:
    """``-coef * KL(behaviour || reference)`` per sampled token (aligned with ``input_ids``), and its
    mean KL per sampled token. The behaviour log-probs are the sampler's, as the rollout saw them."""
    from ctxrl.algo.losses import kl_penalty
    from ctxrl.train.batch import collate, per_token_rows

    sums = {"kl": 0.0, "tokens": 0.0}

    def penalty(batch) -> torch.Tensor:
        ref = reference.logprobs(batch.input_ids, batch.attention_mask, temperature=settings.temperature,
                                 mask=batch.loss_mask, chunk=settings.logprob_chunk_tokens)
        kl = kl_penalty(batch.old_logprobs, ref, kind) * batch.loss_mask
        sums["kl"] += float(kl.sum())
        sums["tokens"] += float(batch.loss_mask.sum())
        return -coef * kl

    device = next(reference.module.parameters()).device
    rows = per_token_rows(collate(episodes, pad_token_id), device, settings.micro_batch_size, penalty,
                          settings.max_tokens_per_microbatch)
    return rows, sums["kl"] / max(sums["tokens"], 1.0)


def error_stats(episodes: list[Episode]) -> dict[str, float]:
    """Errored episodes by kind (``errors_constructor`` ... ``errors_deadline``), and what the deadline dropped.

    A deadline cuts long episodes first, so the episodes left to train on are biased short:
    ``deadline_dropped_tokens_mean`` (tokens an episode held when its deadline fired) next to
    ``kept_tokens_mean`` (tokens of the episodes that finished) shows by how much.
    """
    from ctxrl.rollout.agent import ERROR_KINDS

    errored = [e for e in episodes if e.truncation == "error"]
    out: dict[str, float] = {f"errors_{kind}": float(sum(e.info.get("error_kind") == kind for e in errored))
                             for kind in ERROR_KINDS}
    out["deadline_episodes"] = out["errors_deadline"]
    dropped = [e for e in errored if e.info.get("error_kind") == "deadline"]
    if dropped:
        kept = [e for e in episodes if e.truncation != "error"]

        def tokens(e: Episode) -> int:
            return sum(len(s.input_ids) for s in e.sequences())

        out["deadline_dropped_tokens_mean"] = sum(map(tokens, dropped)) / len(dropped)
        out["kept_tokens_mean"] = sum(map(tokens, kept)) / len(kept) if kept else 0.0
    return out


def drop_small_groups(episodes: list[Episode]) -> tuple[list[Episode], int]:
    """The episodes of groups with at least 2 of them (group statistics need two), and how many episodes went.

    Used after errored episodes are removed: a group left with one valid episode has no baseline.
    """
    counts: dict[int, int] = {}
    for e in episodes:
        counts[e.group_id] = counts.get(e.group_id, 0) + 1
    kept = [e for e in episodes if counts[e.group_id] >= 2]
    return kept, len(episodes) - len(kept)


def trainable(e: Episode) -> bool:
    """Not errored, and something was sampled in it."""
    return e.truncation != "error" and any(any(s.loss_mask) for s in e.sequences())


def logged_eval(run_dir: Path, step: int) -> dict[str, dict[str, float]]:
    """The evaluation rows of ``step`` in ``metrics.jsonl``, by split (for a resumed run's summary)."""
    rows: dict[str, dict[str, float]] = {}
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("phase") == "eval" and row.get("step") == step:
                rows[row["split"]] = row
    return rows


class GracefulStop:
    """SIGINT / SIGTERM ask the run to stop after the current step (a second SIGINT abandons it)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: abandon the step now
        self.signal = signum
        # os.write, not print: a handler that prints can hit a print already in progress
        os.write(2, f"\nctxrl: {signal.Signals(signum).name} received: stopping after this step "
                    "(Ctrl-C again abandons it)\n".encode())

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to the traceback ``exc`` will print (Python 3.11+), or print it now."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        print(note, file=sys.stderr)


def _summary(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The before/after figures of a run's summary (None for a split the environment has no tasks for)."""

    def get(results: dict, split: str, key: str) -> float | None:
        return results[split][key] if split in results else None

    out: dict[str, Any] = {}
    for split in SPLITS:
        out[f"{split}_success_before"] = get(before, split, "success")
        out[f"{split}_success_after"] = get(after, split, "success")
    for split in ("heldout", "ood"):  # generalisation gap: success on the training distribution minus the split's
        train, other = get(after, "train", "success"), get(after, split, "success")
        out[f"gap_{split}_after"] = None if train is None or other is None else train - other
    source = "heldout" if "heldout" in after else "train"
    out["tool_calls_before"] = get(before, source, "tool_calls")
    out["tool_calls_after"] = get(after, source, "tool_calls")
    for split in ("heldout", "ood"):  # trials at evaluation (meta): success by the last attempt, next to attempt 1's
        if "trial_success" in after.get(split, {}):
            out[f"{split}_trial_success_before"] = before[split].get("trial_success")
            out[f"{split}_trial_success_after"] = after[split]["trial_success"]
    return out


def _mean_terms(episodes: list[Episode]) -> dict[str, float]:
    """Mean of each shaped reward term (``info["reward_terms"]``) over all of a step's episodes."""
    sums: dict[str, float] = {}
    for e in episodes:
        for k, v in e.info.get("reward_terms", {}).items():
            sums[k] = sums.get(k, 0.0) + v
    return {k: v / len(episodes) for k, v in sums.items()}


def _zero_variance_groups(episodes: list[Episode]) -> int:
    by_group: dict[int, set[float]] = {}
    for e in episodes:
        by_group.setdefault(e.group_id, set()).add(e.reward)
    return sum(1 for rewards in by_group.values() if len(rewards) == 1)
