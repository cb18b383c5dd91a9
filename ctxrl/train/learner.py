"""Moved to ``ctxrl.learner.learner`` (issue 50); kept so that old imports still work, with a deprecated
``PPOSettings`` factory.

Unlike the other ``ctxrl.train`` shims this is a module of its own, not the moved one (``sys.modules``): it keeps a
name the moved module no longer has. A test that patches the learner's globals patches ``ctxrl.learner.learner``.
"""

from __future__ import annotations

import warnings

from ctxrl.algo.policy_losses.ppo import PPOClipSettings
from ctxrl.learner.learner import LAYOUT_KEYS, Learner, LearnerSettings, micro_batches, per_token_rows, token_logprobs
from ctxrl.sections import AlgoConfig, TrainConfig

__all__ = ["LAYOUT_KEYS", "Learner", "PPOSettings", "micro_batches", "per_token_rows", "token_logprobs"]

_ALGO = ("clip_low", "clip_high", "kl_coef", "kl_kind", "entropy_coef", "agg", "loss", "old_logprobs", "tis_cap")
_TRAIN = ("max_grad_norm", "ppo_epochs", "mini_batches", "micro_batch_size", "logprob_chunk_tokens",
          "pack_sequences", "flat_forward")
_OWN = ("temperature", "norm_length", "distill_top_k_coef", "vf_clip")


def PPOSettings(*, dual_clip: float | None = None, max_tokens_per_microbatch: int = 0, mini_batches: int = 1,  # noqa: N802 - the old class's name
                **flat) -> LearnerSettings:
    """Deprecated: the learner's settings from the flat keywords of the old ``PPOSettings`` class, with its
    defaults (``mini_batches=1``, where ``[train]`` says 2). Build ``LearnerSettings(AlgoConfig(...),
    TrainConfig(...), ...)`` instead, or ``ctxrl.run.build.learner_settings(config)`` for a run's."""
    warnings.warn("ctxrl.train.learner.PPOSettings is deprecated: build ctxrl.learner.learner.LearnerSettings from "
                  "the [algo] and [train] sections", DeprecationWarning, stacklevel=2)
    unknown = sorted(set(flat) - {*_ALGO, *_TRAIN, *_OWN})
    if unknown:
        raise TypeError(f"PPOSettings() got unexpected keyword arguments {', '.join(unknown)}")
    algo = AlgoConfig(**{k: v for k, v in flat.items() if k in _ALGO})
    train = TrainConfig(mini_batches=mini_batches, **{k: v for k, v in flat.items() if k in _TRAIN})
    options = PPOClipSettings(dual_clip=dual_clip) if dual_clip else None  # ([algo.ppo_clip]: ppo_clip's alone)
    return LearnerSettings(algo, train, micro_batch_tokens=max_tokens_per_microbatch, loss_options=options,
                           **{k: v for k, v in flat.items() if k in _OWN})
