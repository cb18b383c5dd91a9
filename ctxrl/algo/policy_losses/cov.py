"""Clip-Cov and KL-Cov: keep the policy's entropy from collapsing by restraining the few tokens whose
log-probability and advantage covary most (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv 2505.22617).

The paper shows the entropy change of a policy-gradient step is driven by the covariance between a token's
log-probability and its advantage, concentrated in a small fraction of tokens. For every sampled token

    cov_t = (A_t - mean(A)) * (log pi(y_t) - mean(log pi))        (means over the batch's sampled tokens)

- ``clip_cov``: PPO-clip, except that ``max(1, int(clip_cov_ratio * N))`` tokens drawn at random among those with
  ``clip_cov_lb < cov_t < clip_cov_ub`` that PPO did not already clip have their loss multiplied by 0 (no
  gradient);
- ``kl_cov``: the unclipped ``-r_t A_t``, plus ``ppo_kl_coef * |log r_t|`` on the ``max(1, int(kl_cov_ratio * N))``
  tokens of largest ``cov_t``.

``N`` is the number of sampled tokens in the call. Choices as verl's ``compute_policy_loss_clip_cov`` /
``compute_policy_loss_kl_cov`` (adapted there from the paper's code): ratios are not clamped before ``exp``; the
defaults (``2e-4`` of the tokens, Clip-Cov's window (1, 5), ``ppo_kl_coef = 1``) are verl's; Clip-Cov's choice is
random, from ``generator`` (``None``: torch's global generator). The selection depends on the batch the function
sees: under gradient accumulation it is made per micro-batch, as in verl. Figures: ``cov_clip_frac`` /
``kl_cov_frac``, the fraction of sampled tokens restrained (verl's ``pg_clipfrac`` for Clip-Cov), PPO's
``clip_frac_low`` / ``clip_frac_high`` for Clip-Cov, ``abs_kl`` (mean ``|log r|``) for KL-Cov.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrl.algo.losses import aggregate
from ctxrl.algo.policy_losses.base import FIGURES, finish, masked_mean, ratio_figures, register_policy_loss
from ctxrl.settings import NON_NEGATIVE, POSITIVE


@torch.no_grad()
def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(A - mean A)(log pi - mean log pi)`` per token, means over mask-1 tokens (no gradient). [B,T] -> [B,T]"""
    return (advantages - masked_mean(advantages, mask)) * (logprobs.detach() - masked_mean(logprobs.detach(), mask))


@dataclass(frozen=True)
class ClipCovSettings:
    """``[algo.clip_cov]`` (PPO's clip range is ``algo.clip_low`` / ``algo.clip_high``)."""

    clip_cov_ratio: float = field(default=2e-4, metadata=POSITIVE)
    """Fraction of the micro-batch's sampled tokens whose gradient is stopped."""
    clip_cov_lb: float = 1.0
    """Lower bound of the covariance window the stopped tokens are drawn from."""
    clip_cov_ub: float = 5.0
    """Upper bound of that window."""


@dataclass(frozen=True)
class KLCovSettings:
    """``[algo.kl_cov]``."""

    kl_cov_ratio: float = field(default=2e-4, metadata=POSITIVE)
    """Fraction of the micro-batch's sampled tokens, those of largest covariance, that get the KL penalty."""
    ppo_kl_coef: float = field(default=1.0, metadata=NON_NEGATIVE)
    """Weight of that penalty, ``abs(log r)`` per token."""


@register_policy_loss("clip_cov", settings=ClipCovSettings, figures=(*FIGURES, "cov_clip_frac"), shared_clips=True)
def clip_cov_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  *, clip_low: float = 0.2, clip_high: float = 0.2, clip_cov_ratio: float = 2e-4,
                  clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, generator: torch.Generator | None = None,
                  agg: str = "token-mean", norm_length: float | None = None, denominator: float | None = None,
                  token_weights: torch.Tensor | None = None, on_device: bool = False) -> tuple[torch.Tensor, dict]:
    """Clip-Cov (module docstring).

    logprobs, old_logprobs, advantages, mask: [B,T]  ->  (scalar loss, metrics)
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    live = mask.bool()
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped_by_ppo = (clipped > unclipped) & live
    covariance = token_covariance(logprobs, advantages, mask)
    candidates = torch.nonzero(live & ~clipped_by_ppo & (covariance > clip_cov_lb) & (covariance < clip_cov_ub))
    keep = torch.ones_like(ratio)
    if len(candidates):
        count = max(int(clip_cov_ratio * float(mask.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count]]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    per_token = torch.maximum(unclipped, clipped) * keep
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, mask, agg, norm_length=norm_length, denominator=denominator)
    metrics = {**ratio_figures(logprobs, old_logprobs, mask),
               "cov_clip_frac": masked_mean(1.0 - keep, mask),
               "clip_frac_low": masked_mean((clipped_by_ppo & (advantages < 0)).to(ratio.dtype), mask),
               "clip_frac_high": masked_mean((clipped_by_ppo & (advantages > 0)).to(ratio.dtype), mask)}
    return loss, finish(metrics, on_device)


@register_policy_loss("kl_cov", settings=KLCovSettings, figures=("approx_kl", "kl_cov_frac", "abs_kl"))
def kl_cov_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 1.0, agg: str = "token-mean",
                norm_length: float | None = None, denominator: float | None = None,
                token_weights: torch.Tensor | None = None, on_device: bool = False) -> tuple[torch.Tensor, dict]:
    """KL-Cov (module docstring).

    logprobs, old_logprobs, advantages, mask: [B,T]  ->  (scalar loss, metrics)
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    live = mask.bool()
    log_ratio = logprobs - old_logprobs
    per_token = -advantages * torch.exp(log_ratio)
    penalised = torch.zeros_like(per_token)
    sampled = torch.nonzero(live.reshape(-1)).squeeze(-1)
    if len(sampled):
        covariance = token_covariance(logprobs, advantages, mask).reshape(-1)[sampled]
        count = max(1, int(len(sampled) * kl_cov_ratio))
        top = sampled[torch.topk(covariance, count, largest=True).indices]
        penalised.view(-1)[top] = 1.0
    per_token = per_token + penalised * ppo_kl_coef * log_ratio.abs()
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, mask, agg, norm_length=norm_length, denominator=denominator)
    metrics = {**ratio_figures(logprobs, old_logprobs, mask), "kl_cov_frac": masked_mean(penalised, mask),
               "abs_kl": masked_mean(log_ratio.detach().abs(), mask)}
    return loss, finish(metrics, on_device)
