"""The learner: batches episodes into tensors, recomputes log-probs, and applies PPO updates.

Token alignment: for a sequence ``x[0..T)``, position ``t`` of the shifted tensors predicts token
``x[t+1]`` from logits at ``t``. So ``loss_mask``, behaviour log-probs and advantages are taken
from ``[1:]`` of the episode's lists, and logits from ``[:-1]``.

Gradient accumulation is exact: each mini-batch's loss is normalised by the mini-batch's total
count (mask-1 tokens for ``token-mean``, live sequences for the ``seq-mean-*`` modes), not by each
micro-batch's, so splitting a mini-batch into micro-batches of uneven lengths changes neither the
loss nor the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ctxrl.algo.losses import aggregate, entropy_from_logits, kl_penalty, policy_loss
from ctxrl.types import Episode


@dataclass
class Batch:
    """Right-padded, shifted tensors for a list of episodes (all [B, T-1] but ``input_ids``)."""

    input_ids: torch.Tensor      # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor        # [B, T-1]
    loss_mask: torch.Tensor      # [B, T-1] float
    old_logprobs: torch.Tensor   # [B, T-1]
    advantages: torch.Tensor     # [B, T-1]


def collate(episodes: list[Episode], pad_token_id: int, device: torch.device | str = "cpu",
            advantages: list[float] | None = None) -> Batch:
    width = max(len(e.input_ids) for e in episodes)
    n = len(episodes)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width))
    old = torch.zeros((n, width))
    for row, ep in enumerate(episodes):
        length = len(ep.input_ids)
        ids[row, :length] = torch.tensor(ep.input_ids)
        attn[row, :length] = 1
        mask[row, :length] = torch.tensor(ep.loss_mask, dtype=torch.float32)
        old[row, :length] = torch.tensor(ep.behavior_logprobs, dtype=torch.float32)
    adv = torch.zeros((n, width))
    if advantages is not None:
        adv = torch.tensor(advantages, dtype=torch.float32).unsqueeze(-1).expand(n, width).clone()
    adv = adv * mask
    return Batch(ids.to(device), attn.to(device), ids[:, 1:].to(device), mask[:, 1:].to(device),
                 old[:, 1:].to(device), adv[:, 1:].to(device))


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                   return_logits: bool = False):
    """Log-probs [B, T-1] of each next token under ``model`` at ``temperature``."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return (logprobs, logits) if return_logits else logprobs


@dataclass
class PPOSettings:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batch_size: int = 32


class Learner:
    """Owns the policy's optimiser (and an optional frozen reference) and runs PPO updates."""

    def __init__(self, model, optimizer: torch.optim.Optimizer, settings: PPOSettings, *, pad_token_id: int,
                 ref_model=None, seed: int = 0) -> None:
        self.model = model
        self.optimizer = optimizer
        self.settings = settings
        self.pad_token_id = pad_token_id
        self.ref_model = ref_model
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_updates = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update(self, episodes: list[Episode], advantages: list[float]) -> dict[str, float]:
        """PPO epochs over ``episodes`` in mini-batches; returns metrics averaged over mini-batches."""
        s = self.settings
        self.model.train()
        totals: dict[str, float] = {}
        count = 0
        for _ in range(s.ppo_epochs):
            order = torch.randperm(len(episodes), generator=self.generator).tolist()
            chunk = math.ceil(len(order) / s.mini_batches)
            for start in range(0, len(order), chunk):
                idx = order[start:start + chunk]
                metrics = self.mini_batch_step([episodes[i] for i in idx], [advantages[i] for i in idx])
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1
        return {k: v / max(count, 1) for k, v in totals.items()}

    def mini_batch_loss(self, episodes: list[Episode], advantages: list[float]) -> dict[str, float]:
        """Accumulate gradients of one mini-batch over micro-batches (no optimiser step)."""
        s = self.settings
        tokens = float(sum(sum(e.loss_mask[1:]) for e in episodes))
        live = float(sum(1 for e in episodes if any(e.loss_mask[1:])))
        denominator = tokens if s.agg == "token-mean" else live
        norm_length = max((sum(e.loss_mask) for e in episodes), default=1)
        sums: dict[str, float] = {}
        for start in range(0, len(episodes), s.micro_batch_size):
            eps = episodes[start:start + s.micro_batch_size]
            batch = collate(eps, self.pad_token_id, self.device, advantages[start:start + s.micro_batch_size])
            logprobs, logits = token_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                              temperature=s.temperature, return_logits=True)
            loss, m = policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                  clip_low=s.clip_low, clip_high=s.clip_high, agg=s.agg,
                                  norm_length=norm_length, denominator=denominator)
            picked = logits[batch.loss_mask.bool()]
            if s.entropy_coef > 0:
                entropy_tokens = torch.zeros_like(logprobs)
                entropy_tokens[batch.loss_mask.bool()] = entropy_from_logits(picked)
                loss = loss - s.entropy_coef * aggregate(entropy_tokens, batch.loss_mask, s.agg,
                                                         norm_length=norm_length, denominator=denominator)
            if s.kl_coef > 0 and self.ref_model is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.ref_model, batch.input_ids, batch.attention_mask,
                                         temperature=s.temperature)
                kl = kl_penalty(logprobs, ref, s.kl_kind)
                loss = loss + s.kl_coef * aggregate(kl, batch.loss_mask, s.agg, norm_length=norm_length,
                                                    denominator=denominator)
                sums["kl"] = sums.get("kl", 0.0) + float((kl.detach() * batch.loss_mask).sum())
            loss.backward()
            n_tok = float(batch.loss_mask.sum())
            with torch.no_grad():
                sums["loss"] = sums.get("loss", 0.0) + float(loss)
                sums["entropy"] = sums.get("entropy", 0.0) + float(entropy_from_logits(picked.detach()).sum())
                delta = (logprobs.detach() - batch.old_logprobs).abs() * batch.loss_mask
                sums["logprob_mismatch"] = sums.get("logprob_mismatch", 0.0) + float(delta.sum())
                for key in ("clip_frac_low", "clip_frac_high", "approx_kl"):
                    sums[key] = sums.get(key, 0.0) + m[key] * n_tok
        out = {"loss": sums["loss"]}
        for key in ("entropy", "logprob_mismatch", "clip_frac_low", "clip_frac_high", "approx_kl", "kl"):
            if key in sums:
                out[key] = sums[key] / max(tokens, 1.0)
        return out

    def mini_batch_step(self, episodes: list[Episode], advantages: list[float]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.mini_batch_loss(episodes, advantages)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        if not torch.isfinite(grad_norm) or not math.isfinite(metrics["loss"]):
            # Never let a non-finite step touch the weights or the optimiser state.
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            metrics["skipped"] = 1.0
        else:
            self.optimizer.step()
            metrics["skipped"] = 0.0
        metrics["grad_norm"] = float(grad_norm)
        return metrics
