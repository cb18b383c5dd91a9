"""One RL step, top to bottom: collect -> filter -> estimate -> update -> sync the engine -> log.

``rl_step(run, step)`` reads as the step does; each phase is a function of the run (``ctxrl.run.parts.Run``, the
parts ``ctxrl.run.build.build`` assembled) and returns what the next phase takes:

1. ``collect``: the step's episodes (``ctxrl.run.collect.Collector``: the curriculum's tasks, ``group_size``
   episodes each, dynamic sampling, asynchronous or lagged rounds);
2. ``keep_trainable``: the curriculum sees the step; errored episodes are logged and left out (too many abort
   the run, ``ctxrl.run.health``); groups too small for group statistics are dropped;
3. ``estimate``: per-token advantages (after a KL penalty in the reward and the critic's values, if any, and a
   distillation teacher's scores), then SimpleTIR's void-turn filter; roles with policies of their own take
   their rows;
4. ``update``: the learner's PPO updates on the collated rows (and each own role's), the health check of the
   weights, the streak of skipped updates;
5. ``sync_engine``: the new weights to the worker's engine as version ``step + 1`` (in one process with
   ``distributed.max_staleness``, the weights held that many versions back: ``ctxrl.distributed.staleness``);
6. ``log_step``: the step's metrics row and samples; the abort after too many skipped updates in a row.

``train.objective = "sft"`` (the SFT-only control of an RL claim) replaces 1-5 with SFT on fresh demos
(``ctxrl.train.sft_control.control_step``). Tests that watch a phase patch it here (``ctxrl.run.step.update``):
``rl_step`` looks each one up in this module when it runs.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ctxrl.algo.filters import drop_small_groups, void_turn_free
from ctxrl.learner.policy import Reference
from ctxrl.learner.settings import LearnerSettings
from ctxrl.learner.teacher import Teacher
from ctxrl.run import checkpoint, health
from ctxrl.run.collect import Collected, trainable
from ctxrl.run.engine_sync import current_weights, sync_engine  # noqa: F401 - phase 5, patched here by tests
from ctxrl.run.health import TrainingAborted
from ctxrl.run.metrics import error_stats, step_row
from ctxrl.types import Episode, TrainSequence


def rl_step(run, step: int) -> dict[str, Any]:
    """One RL step (the module docstring); returns its metrics row."""
    if run.learner is None:
        raise RuntimeError("start the learner (ctxrl.run.build.start_learning) before the first RL step")
    if run.config.train.objective == "sft":  # the SFT-only control: demos instead of rollouts
        from ctxrl.train.sft_control import control_step

        return control_step(run, step)
    t0 = time.perf_counter()
    collected = collect(run, step)
    t_rollout = time.perf_counter() - t0
    valid = keep_trainable(run, step, collected)
    rows, trained_episodes = estimate(run, valid, collected.metrics)
    t1 = time.perf_counter()
    figures = update(run, rows, step)
    sync_engine(run, step + 1)
    times = {"time_rollout": t_rollout, "time_update": time.perf_counter() - t1}
    return log_step(run, step, collected, valid, rows, trained_episodes, figures, times, t0)


def collect(run, step: int) -> Collected:
    """Phase 1: play the step's episodes (``ctxrl.run.collect``)."""
    return run.collector.collect(step)


def keep_trainable(run, step: int, collected: Collected) -> list[Episode]:
    """Phase 2: the curriculum sees the step; errored episodes are logged and left out (too many abort); groups
    too small for group statistics are dropped. Returns the episodes to estimate on."""
    c, metrics = run.config, collected.metrics
    episodes = collected.episodes
    metrics.update(run.curriculum.update([e for e in episodes if e.truncation != "error"]))
    metrics["max_turns"] = run.curriculum.max_turns(step, c.env.max_turns)
    if run.manager.keeps_budget(c.context.max_context_tokens):
        metrics["context_budget"] = run.collector.context_budget(step)
    errored = [e for e in episodes if e.truncation == "error"]
    if errored:  # every errored episode is kept, with its reason, whatever samples_per_step says
        run.writer.log_samples(step + 1, errored, run.renderer.decode, phase="rl-errored")
        run.progress.errored(f"step {step + 1}", len(errored), len(episodes), errored[0].info.get("error"))
    hint = health.hint(run.writer.dir, c.train.checkpoint_every)
    error_rate = health.check_errors(episodes, step, max_error_rate=c.rollout.max_error_rate,
                                     samples=run.writer.dir / "samples.jsonl", hint=hint)
    health.check_sampled(episodes, step, lr=c.train.lr, hint=hint)
    valid = [e for e in collected.train if trainable(e)]
    dropped = 0
    if run.estimator.needs_groups:  # group statistics need two valid episodes
        valid, dropped = drop_small_groups(valid)
    metrics.update({"errored_episodes": len(errored), "error_rate": error_rate,
                    "episodes_dropped_small_groups": dropped, **error_stats(episodes)})
    return valid


def estimate(run, valid: list[Episode], metrics: dict[str, Any]) -> tuple[list[TrainSequence], int]:
    """Phase 3: per-token advantages (after a KL penalty in the reward and the critic's values, if any), then the
    void-turn filter. Returns the training rows and how many episodes they come from."""
    a, c = run.config.algo, run.config
    pad = run.renderer.tokenizer.pad_token_id
    penalties = values = None
    if a.kl_coef > 0 and a.kl_placement == "reward" and valid:
        penalties, metrics["kl_reward"] = kl_reward_penalties(
            run.learner.reference, valid, pad, coef=a.kl_coef, kind=a.kl_kind, settings=run.learner.settings)
    if run.estimator.needs_critic and valid:
        from ctxrl.learner.critic import episode_values

        values = episode_values(run.learner.critic, valid, pad, micro_batch_size=c.train.micro_batch_size,
                                max_tokens=run.micro_batch_tokens)
    extra = teacher_scores(run.teacher, valid, pad, metrics)
    policy = run.spec.train.context
    per_episode = run.estimator.estimate(valid, token_rewards=penalties, values=values,
                                         segment_bonus=lambda s: run.manager.segment_bonus(s, policy), **extra
                                         ) if valid else []
    free = void_turn_free(valid)
    metrics["void_turn_rate"] = (1.0 - sum(free) / len(free)) if free else 0.0
    if a.void_turn_filter:
        metrics["void_turn_filtered"] = len(free) - sum(free)
    kept = [(e, rows) for e, rows, keep in zip(valid, per_episode, free) if keep or not a.void_turn_filter]
    shared = run.own.take([e for e, _ in kept], [rows for _, rows in kept])  # (roles with policies of their own)
    return [row for rows in shared for row in rows], len(kept)


def update(run, rows: list[TrainSequence], step: int) -> dict[str, float]:
    """Phase 4: PPO updates on the collated rows (the shared policy's and each own role's), the weights checked,
    the streak of steps whose every update was skipped counted. Returns the update's figures."""
    learner = run.learner
    run.followers.update(rows)  # (data-parallel: the follower ranks train on their shares of the same rows)
    figures = {**(learner.update(learner.collate(rows)) if rows else {}), **run.own.update()}
    if rows:
        health.check_update(checkpoint.non_finite_weights(learner) + run.own.non_finite(), step,
                            lr=run.config.train.lr, hint=health.hint(run.writer.dir, run.config.train.checkpoint_every))
    # every mini-batch update of the step was skipped, the shared policy's or a role's own
    if figures and (figures.get("skipped", 0.0) >= 1.0 or run.own.skipped_all(figures)):
        run.consecutive_skips += 1
    elif figures:
        run.consecutive_skips = 0
    figures["skipped_updates_total"] = float(learner.skipped_updates)
    return figures


def log_step(run, step: int, collected: Collected, valid: list[Episode], rows: list[TrainSequence],
             trained_episodes: int, figures: dict[str, float], times: dict[str, float], t0: float) -> dict[str, Any]:
    """Phase 6: the step's metrics row and samples; abort after too many skipped updates in a row."""
    c, episodes = run.config, collected.episodes
    row = step_row(step, collected, valid, rows, trained_episodes, figures, times, t0, manager=run.manager,
                   spec=run.spec, device=run.device)
    run.writer.log_metrics(row)
    if c.run.samples_per_step:
        run.writer.log_samples(step + 1, episodes[: c.run.samples_per_step], run.renderer.decode, phase="rl")
    if run.consecutive_skips >= c.train.max_consecutive_skips:
        raise TrainingAborted(
            f"{run.consecutive_skips} RL steps in a row had every update skipped (non-finite loss or gradient "
            f"norm; train.max_consecutive_skips={c.train.max_consecutive_skips}). The weights were not touched "
            "by those steps." + checkpoint.resume_hint(run.writer.dir, c.train.checkpoint_every))
    return row


def teacher_scores(teacher: Teacher | None, valid: list[Episode], pad_token_id: int,
                   metrics: dict[str, Any]) -> dict[str, Any]:
    """On-policy distillation: the teacher's log-probs of the sampled tokens, as the estimator's ``teacher_logprobs``
    (its KL figures go into ``metrics``), and with ``top_k`` its likeliest tokens (``teacher_topk``); nothing
    without a teacher."""
    if teacher is None or not valid:
        return {}
    if teacher.top_k <= 0:
        logprobs, figures = teacher.score(valid, pad_token_id)
        metrics.update(figures)
        return {"teacher_logprobs": logprobs}
    logprobs, topk, figures = teacher.score_topk(valid, pad_token_id)  # (one forward pass for both)
    metrics.update(figures)
    return {"teacher_logprobs": logprobs, "teacher_topk": topk}


@torch.no_grad()
def kl_reward_penalties(reference: Reference, episodes: list[Episode], pad_token_id: int, *, coef: float, kind: str,
                        settings: LearnerSettings) -> tuple[list[list[float]], float]:
    """``-coef * KL(behaviour || reference)`` per sampled token (aligned with ``input_ids``), and its
    mean KL per sampled token. The behaviour log-probs are the sampler's, as the rollout saw them."""
    from ctxrl.algo.losses import kl_penalty
    from ctxrl.learner.batch import collate, per_token_rows

    sums = {"kl": 0.0, "tokens": 0.0}

    def penalty(batch) -> torch.Tensor:
        ref = reference.logprobs(batch.input_ids, batch.attention_mask, temperature=settings.temperature,
                                 mask=batch.loss_mask, chunk=settings.train.logprob_chunk_tokens)
        kl = kl_penalty(batch.old_logprobs, ref, kind) * batch.loss_mask
        sums["kl"] += float(kl.sum())
        sums["tokens"] += float(batch.loss_mask.sum())
        return -coef * kl

    device = next(reference.module.parameters()).device
    rows = per_token_rows(collate(episodes, pad_token_id), device, settings.train.micro_batch_size, penalty,
                          settings.micro_batch_tokens)
    return rows, sums["kl"] / max(sums["tokens"], 1.0)
