"""The SFT-only control of an RL claim (``train.objective = "sft"``): the same warm start, the same number of
optimiser steps, no RL.

An effect is RL's own only beyond what more supervised training from the same warm start would have given (issue
49). So each step of a control run trains on fresh demos of the warm start's own mix (its shortcuts, its trials, its
context demos, a format-only warm start's other environment, in the same proportions; new tasks every step)
instead of rollouts: ``train.ppo_epochs`` x ``train.mini_batches`` optimiser steps, as many as an RL step takes,
each a batch of ``sft.batch_size`` sequences drawn at random from the step's demos (so the mix's share of
sequences holds), through the learner's own optimiser at ``train.lr`` (its float32 masters, clipping at
``train.max_grad_norm``, checkpoints and resume): only the objective differs from the RL run. A plan may run a
second control at a higher ``train.lr`` (the warm start's ``sft.lr``, say) and report the stronger of the two.
Evaluations, their cadence and the run directory are an RL run's, so the two compare step for step. "More SFT" in
the other sense (a warm start with more demos) is a plain run with a larger ``sft.demos``.

Its rows are ``phase = "sft_control"``: the step's mean loss, the demos and sequences it trained on, its time.
"""

from __future__ import annotations

import random
import time
from typing import Any

from ctxrl.algo.estimators.base import broadcast
from ctxrl.run.engine_sync import sync_engine
from ctxrl.seeds import Seeds
from ctxrl.train.sft import sft_step
from ctxrl.train.warm_start import demo_mix
from ctxrl.types import Episode, TrainSequence


def updates_per_step(config) -> int:
    """Optimiser steps one RL step takes, which the control matches: ``ppo_epochs`` x ``mini_batches``."""
    return config.train.ppo_epochs * config.train.mini_batches


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


def control_demos(run, step: int) -> list[Episode]:
    """Fresh demos of the warm start's mix for step ``step`` (``ctxrl.train.warm_start.demo_mix``): as many demos as
    the step's sequences, ``updates_per_step`` batches of ``sft.batch_size``."""
    config = run.config
    seed = Seeds(config.run.seed).control_demos(step)
    return demo_mix(config, run.spec, run.env_cls, run.renderer,
                    updates_per_step(config) * config.sft.batch_size, under_manager=run.context_demos,
                    seeds=(seed, seed + 1, seed + 2))


def control_step(run, step: int) -> dict[str, Any]:
    """One step of the SFT-only control (the module docstring); the engine gets the weights as ``step + 1``."""
    config, learner = run.config, run.learner
    t0 = time.perf_counter()
    demos = control_demos(run, step)
    size = updates_per_step(config) * config.sft.batch_size
    rows = [row for e in demos for row in broadcast(e, 1.0)]  # (a summarising demo gives several)
    random.Random(Seeds(config.run.seed).control_demos(step)).shuffle(rows)  # the mix's share of sequences, kept
    rows = rows[:size]
    model = run.model
    model.train()
    device = next(model.parameters()).device
    losses = [sft_step(model, batch, learner.optimizer, pad_token_id=run.tokenizer.pad_token_id, device=device,
                       precision=learner.precision, chunk=config.train.logprob_chunk_tokens,
                       max_tokens=run.micro_batch_tokens, micro_rows=config.train.micro_batch_size,
                       max_grad_norm=config.train.max_grad_norm)
              for batch in split_rows(rows, updates_per_step(config))]
    sync_engine(run, step + 1)
    row = {"phase": "sft_control", "step": step + 1, "sft_loss": sum(losses) / len(losses),
           "optimizer_steps": len(losses), "demos": len(demos), "trained_sequences": len(rows),
           "time_step": time.perf_counter() - t0}
    run.writer.log_metrics(row)
    return row
