"""Checks that stop a run whose numbers stopped meaning anything (issue 33): too many errored episodes, weights
holding NaN or infinity after an update, and episodes sampled with NaN log-probabilities (a checkpoint of such
weights is refused where it is saved: ``checkpoint.refuse_non_finite``). Each error names the step, the setting to
change and the checkpoint to resume from; nothing non-finite is saved or handed to the engine.
"""

from __future__ import annotations

import math

from ctxrl.run.checkpoint import resume_hint
from ctxrl.types import Episode


class TrainingAborted(RuntimeError):
    """The run stopped itself (too many skipped updates, too many errored episodes); the message says why."""


def hint(run_dir, checkpoint_every: int) -> str:
    """How to go on from the run's last good checkpoint (``checkpoint.resume_hint``)."""
    return resume_hint(run_dir, checkpoint_every)


def check_errors(episodes: list[Episode], step: int, *, max_error_rate: float, samples, hint: str) -> float:
    """The share of ``episodes`` that errored; ``TrainingAborted`` when it passes ``max_error_rate``
    (``rollout.max_error_rate``), naming ``samples`` (where the errored episodes are) and ``hint``."""
    errored = [e for e in episodes if e.truncation == "error"]
    rate = len(errored) / max(len(episodes), 1)
    if rate > max_error_rate:
        raise TrainingAborted(
            f"step {step + 1}: {len(errored)} of {len(episodes)} episodes errored (rate {rate:.2f} > "
            f"rollout.max_error_rate={max_error_rate}); first error: {errored[0].info.get('error')}. "
            f"The episodes are in {samples} (phase rl-errored)." + hint)
    return rate


def check_sampled(episodes: list[Episode], step: int, *, lr: float, hint: str) -> None:
    """``TrainingAborted`` when the engine sampled episodes with NaN log-probabilities: its weights are finite
    (``check_update`` saw to that) but too large to give numbers (``lr``: ``train.lr``, named in the message)."""
    broken = [e for e in episodes if e.truncation != "error" and any(
        math.isnan(x) for seq in e.sequences() for x in seq.behavior_logprobs)]
    if broken:
        raise TrainingAborted(
            f"step {step + 1}: the policy (version {broken[0].policy_version}) sampled {len(broken)} of "
            f"{len(episodes)} episodes with NaN log-probabilities: its weights are finite but too large to give "
            f"numbers, so nothing can be learnt from them (an update too large for the model; train.lr={lr:g})."
            + hint)


def check_update(bad: list[str], step: int, *, lr: float, hint: str) -> None:
    """``TrainingAborted`` when the update left NaN or infinite values in trained tensors (``bad``, their names:
    ``non_finite_weights(learner)`` and each own role's): they are never trained on, saved or handed to the
    engine."""
    if bad:
        raise TrainingAborted(
            f"step {step + 1}: the update left NaN or infinite values in {len(bad)} trained tensors "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}) although its loss and gradient norm were "
            f"finite: a step too large for the weights (train.lr={lr:g}). They were neither saved nor "
            "given to the engine." + hint)
