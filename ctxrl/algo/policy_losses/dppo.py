"""DPPO: a trust region on the divergence of each token's distribution, not on its probability ratio (Qi et al.
2026, "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879).

PPO's ratio clip over-restrains rare tokens (a tiny probability doubles easily) and under-restrains likely ones
(0.9 -> 0.5 is a ratio of only 0.56). DPPO masks a token when the binary divergence between the old and new
distributions ``(p_old, 1 - p_old)`` and ``(p, 1 - p)`` of the sampled token, ``p = pi(y_t)``, leaves its bound
in the direction the advantage pushes:

- ``dppo_tv``: the total variation ``p - p_old``: for ``A > 0`` the token trains while ``p - p_old <= clip_high``,
  for ``A <= 0`` while ``p - p_old >= -clip_low``;
- ``dppo_kl``: the binary KL ``p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))``: for ``A > 0`` the
  token trains while it is ``<= clip_high`` or ``p <= p_old``; for ``A <= 0`` while ``<= clip_low`` or
  ``p >= p_old`` (1e-8 is added inside the second log, as verl does, so ``p = 1`` stays finite).

A token inside trains as a truncated-IS policy gradient (no dual clip):

    loss_t = -A_t * sg(min(r_t, truncation)) * log pi(y_t) * sg(valid_t),    r_t = exp(log pi - log pi_old)

(as CISPO, the value is not a surrogate; only the gradient is). Choices as verl's ``compute_policy_loss_dppo_tv``
/ ``_dppo_kl``: log-ratio clamped to [-20, 20]; ``truncation = 20`` (a large cap, the paper's section 5.4);
bounds 0.15 (TV) and 0.05 (KL), those of verl's DPPO example. Figures: ``clip_frac_high`` / ``clip_frac_low``,
the fractions of sampled tokens masked with ``A > 0`` / ``A <= 0`` (their sum is verl's ``pg_clipfrac``), and
``truncated_frac``, the tokens inside whose weight was truncated (verl's ``pg_clipfrac_lower``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrl.algo.losses import aggregate
from ctxrl.algo.policy_losses.base import FIGURES, finish, masked_mean, ratio_figures, register_policy_loss
from ctxrl.settings import NON_NEGATIVE, POSITIVE


def _divergence_loss(logprobs, old_logprobs, advantages, mask, valid, *, truncation, agg, norm_length, denominator,
                     token_weights, on_device):
    """The truncated-IS gradient on the tokens ``valid`` keeps, and the figures."""
    if truncation <= 0:
        raise ValueError(f"truncation must be > 0, got {truncation}")
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))
    valid = valid.detach().to(ratio.dtype)
    per_token = -advantages * ratio.clamp(max=truncation).detach() * logprobs * valid
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, mask, agg, norm_length=norm_length, denominator=denominator)
    masked = 1.0 - valid
    metrics = {**ratio_figures(logprobs, old_logprobs, mask),
               "clip_frac_high": masked_mean(masked * (advantages > 0), mask),
               "clip_frac_low": masked_mean(masked * (advantages <= 0), mask),
               "truncated_frac": masked_mean((ratio > truncation).to(ratio.dtype) * valid, mask)}
    return loss, finish(metrics, on_device)


@dataclass(frozen=True)
class DPPOTVSettings:
    """``[algo.dppo_tv]``: the bounds of ``p - p_old`` and the importance weight's cap."""

    clip_low: float = field(default=0.15, metadata=NON_NEGATIVE)
    """How far ``p`` may fall below ``p_old`` on a token with ``A <= 0``."""
    clip_high: float = field(default=0.15, metadata=NON_NEGATIVE)
    """How far ``p`` may rise above ``p_old`` on a token with ``A > 0``."""
    truncation: float = field(default=20.0, metadata=POSITIVE)
    """Cap of the importance weight ``r``."""


@dataclass(frozen=True)
class DPPOKLSettings:
    """``[algo.dppo_kl]``: the bounds of the binary KL and the importance weight's cap."""

    clip_low: float = field(default=0.05, metadata=NON_NEGATIVE)
    """Bound of the binary KL on a token with ``A <= 0``."""
    clip_high: float = field(default=0.05, metadata=NON_NEGATIVE)
    """Bound of the binary KL on a token with ``A > 0``."""
    truncation: float = field(default=20.0, metadata=POSITIVE)
    """Cap of the importance weight ``r``."""


DPPO_FIGURES = (*FIGURES, "truncated_frac")


@register_policy_loss("dppo_tv", settings=DPPOTVSettings, figures=DPPO_FIGURES)
def dppo_tv_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 *, clip_low: float = 0.15, clip_high: float = 0.15, truncation: float = 20.0,
                 agg: str = "token-mean", norm_length: float | None = None, denominator: float | None = None,
                 token_weights: torch.Tensor | None = None, on_device: bool = False) -> tuple[torch.Tensor, dict]:
    """DPPO-Binary-TV (module docstring).

    logprobs, old_logprobs, advantages, mask: [B,T]  ->  (scalar loss, metrics)
    """
    with torch.no_grad():
        shift = torch.exp(logprobs) - torch.exp(old_logprobs)
        valid = torch.where(advantages > 0, shift <= clip_high, shift >= -clip_low)
    return _divergence_loss(logprobs, old_logprobs, advantages, mask, valid, truncation=truncation, agg=agg,
                            norm_length=norm_length, denominator=denominator, token_weights=token_weights,
                            on_device=on_device)


@register_policy_loss("dppo_kl", settings=DPPOKLSettings, figures=DPPO_FIGURES)
def dppo_kl_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 *, clip_low: float = 0.05, clip_high: float = 0.05, truncation: float = 20.0,
                 agg: str = "token-mean", norm_length: float | None = None, denominator: float | None = None,
                 token_weights: torch.Tensor | None = None, on_device: bool = False) -> tuple[torch.Tensor, dict]:
    """DPPO-Binary-KL (module docstring).

    logprobs, old_logprobs, advantages, mask: [B,T]  ->  (scalar loss, metrics)
    """
    with torch.no_grad():
        p, p_old = torch.exp(logprobs), torch.exp(old_logprobs)
        binary_kl = (p_old * (old_logprobs - logprobs)
                     + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)))
        valid = torch.where(advantages > 0, (binary_kl <= clip_high) | (p <= p_old),
                            (binary_kl <= clip_low) | (p >= p_old))
    return _divergence_loss(logprobs, old_logprobs, advantages, mask, valid, truncation=truncation, agg=agg,
                            norm_length=norm_length, denominator=denominator, token_weights=token_weights,
                            on_device=on_device)
