"""Supervised warm start: cross-entropy on the assistant (mask-1) tokens of demonstrations.

The demonstrations are played by ``ctxrl.demos.play`` (the environment's scripted solutions through the real
agent loop, so their ids and masks are built exactly like RL rollouts); a demo that summarised trains each
segment, its summary tokens included.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ctxrl.algo.estimators.base import broadcast
from ctxrl.learner.batch import collate, micro_batches
from ctxrl.learner.forward import Forward, choose
from ctxrl.learner.precision import Precision, trainable_grads
from ctxrl.models.kernels import attention_kernels
from ctxrl.types import Episode, TrainSequence


def sft_train(model, episodes: list[Episode], *, pad_token_id: int, epochs: int, batch_size: int, lr: float,
              seed: int = 0, on_step: Callable[[int, int, float], None] | None = None,
              precision: Precision | None = None, chunk: int = 0, max_tokens: int = 0) -> list[float]:
    """Cross-entropy on mask-1 tokens, token-mean per batch; returns the loss of every step.

    A segmented episode (a demo that summarised) trains each segment as its own sequence, as in RL;
    ``batch_size`` counts sequences. Only parameters with ``requires_grad`` train (LoRA: the
    adapters). ``precision``: master weights and loss scaling (``ctxrl.learner.precision``); ``chunk``:
    positions per chunk of the output head (``ctxrl.learner.logprobs``); ``max_tokens``: split each
    batch into micro-batches of at most this many padded tokens (0: the whole batch at once); the
    loss is normalised by the whole batch's token count, so the split changes no gradient.
    """
    episodes = [row for e in episodes for row in broadcast(e, 1.0)]
    device = next(model.parameters()).device
    precision = precision or Precision()
    optimizer = precision.optimizer(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    steps_per_epoch = math.ceil(len(episodes) / batch_size)
    total = steps_per_epoch * epochs
    warmup = max(1, total // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(episodes), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            losses.append(sft_step(model, [episodes[i] for i in order[start:start + batch_size]], optimizer,
                                   pad_token_id=pad_token_id, device=device, precision=precision, chunk=chunk,
                                   max_tokens=max_tokens, micro_rows=batch_size))
            scheduler.step()
            if on_step is not None:
                on_step(len(losses), total, losses[-1])
    if hasattr(optimizer, "close"):  # a MasterAdamW's gradient hooks: the RL optimiser comes next
        optimizer.close()
    return losses


def sft_step(model, rows: list[TrainSequence], optimizer, *, pad_token_id: int, device, precision: Precision,
             chunk: int = 0, max_tokens: int = 0, micro_rows: int = 0, max_grad_norm: float = 1.0) -> float:
    """One optimiser step of cross-entropy on the mask-1 tokens of ``rows`` (token-mean over the whole batch, in
    micro-batches of at most ``max_tokens`` padded tokens); returns the loss. A non-finite gradient norm skips the
    step, as the learner does. ``sft_train`` and the SFT-only control (``ctxrl.train.sft_control``) share it."""
    batch = collate(rows, pad_token_id)
    tokens = batch.loss_mask.sum().clamp(min=1.0)
    optimizer.zero_grad(set_to_none=True)
    batch_loss = 0.0
    forward = Forward(model, choose(model, None, "sft"), chunk=chunk)
    with attention_kernels(device):  # (the backward pass too: checkpointing recomputes attention there)
        for _, micro in micro_batches(batch, micro_rows or len(rows), device, max_tokens):
            logprobs = forward.logprobs(micro)
            loss = -(logprobs * micro.loss_mask).sum() / tokens
            if loss.requires_grad:
                precision.backward(loss)
            batch_loss += loss.item()
    precision.unscale(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(trainable_grads(optimizer), max_grad_norm)
    if torch.isfinite(norm):
        precision.step(optimizer)
    else:
        optimizer.zero_grad(set_to_none=True)
    precision.update()
    return batch_loss
