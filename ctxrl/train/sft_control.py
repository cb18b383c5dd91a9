"""The SFT-only control of an RL claim (``train.objective = "sft"``): the same warm start, the same number of
optimiser steps, no RL.

An effect is RL's own only beyond what more supervised training from the same warm start would have given (issue
49). So each step of a control run trains on fresh demos of the warm start's own mix (its shortcuts, its context
demos, a format-only warm start's other environment, in the same proportions; new tasks every step) instead of
rollouts: ``train.ppo_epochs`` x ``train.mini_batches`` optimiser steps, as many as an RL step takes, each a batch of
``sft.batch_size`` sequences, at ``sft.lr`` held constant, through the learner's own optimiser (its float32
masters, clipping at ``train.max_grad_norm``, checkpoints and resume). Evaluations, their cadence and the run
directory are an RL run's, so the two compare step for step. It is deliberately the *same recipe continued*; "more
SFT" in the other sense (a warm start with more demos) is a plain run with a larger ``sft.demos``.

Its rows are ``phase = "sft_control"``: the step's mean loss, the demos and sequences it trained on, its time.
"""

from __future__ import annotations

import time
from typing import Any

from ctxrl.algo.estimators.base import broadcast
from ctxrl.seeds import Seeds
from ctxrl.train.sft import sft_step
from ctxrl.train.warm_start import play_demos, play_format_demos
from ctxrl.types import Episode, TrainSequence


def updates_per_step(config) -> int:
    """Optimiser steps one RL step takes, which the control matches: ``ppo_epochs`` x ``mini_batches``."""
    return config.train.ppo_epochs * config.train.mini_batches


def demo_mix(config, n: int) -> tuple[int, int]:
    """(demos of the run's environment, demos of ``sft.format_demos_env``) among ``n``, in the warm start's
    proportions (at least one of the run's own)."""
    c = config.sft
    other = c.format_demos if c.format_demos_env else 0
    n_other = round(n * other / (c.demos + other)) if other else 0
    n_other = min(n_other, n - 1)
    return n - n_other, n_other


def split_rows(rows: list[TrainSequence], parts: int) -> list[list[TrainSequence]]:
    """``rows`` in ``parts`` consecutive batches as equal as they can be (none empty while rows last)."""
    parts = max(1, min(parts, len(rows)))
    size, extra = divmod(len(rows), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(rows[start:end])
        start = end
    return out


def control_demos(trainer, step: int) -> list[Episode]:
    """Fresh demos for step ``step``: enough for ``updates_per_step`` batches of ``sft.batch_size`` demos."""
    config = trainer.config
    seed = Seeds(config.run.seed).control_demos(step)
    own, other = demo_mix(config, updates_per_step(config) * config.sft.batch_size)
    demos = play_demos(config, trainer.spec, trainer.env_cls, trainer.renderer, own,
                       under_manager=trainer.context_demos, seed=seed)
    if other:
        demos += play_format_demos(config, trainer.spec, trainer.renderer, other, seed=seed + 1)
    return demos


def control_step(trainer, step: int) -> dict[str, Any]:
    """One step of the SFT-only control (the module docstring); the engine gets the weights as ``step + 1``."""
    config, learner = trainer.config, trainer.learner
    t0 = time.perf_counter()
    demos = control_demos(trainer, step)
    size = updates_per_step(config) * config.sft.batch_size
    rows = [row for e in demos for row in broadcast(e, 1.0)][:size]  # (a summarising demo gives several)
    for group in learner.optimizer.param_groups:  # the recipe continued: the warm start's rate, held constant
        group["lr"] = config.sft.lr
    model = trainer.model
    model.train()
    device = next(model.parameters()).device
    losses = [sft_step(model, batch, learner.optimizer, pad_token_id=trainer.tokenizer.pad_token_id, device=device,
                       precision=learner.precision, chunk=config.train.logprob_chunk_tokens,
                       max_tokens=config.train.max_tokens_per_microbatch, micro_rows=config.train.micro_batch_size,
                       max_grad_norm=config.train.max_grad_norm)
              for batch in split_rows(rows, updates_per_step(config))]
    trainer.sync_engine(step + 1)
    row = {"phase": "sft_control", "step": step + 1, "sft_loss": sum(losses) / len(losses),
           "optimizer_steps": len(losses), "demos": len(demos), "trained_sequences": len(rows),
           "time_step": time.perf_counter() - t0}
    trainer.writer.log_metrics(row)
    return row
