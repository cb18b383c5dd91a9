"""CISPO: clip the importance weight, not the update (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585).

PPO-clip zeroes the gradient of a token whose ratio left the clip range; in long reasoning the tokens that
leave it first are rare, pivotal ones ("However", "Wait"). CISPO keeps every token's gradient and bounds its
weight instead: per token

    loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi(y_t),    r_t = exp(log pi - log pi_old)

so the gradient is ``-clip(r_t) A_t grad log pi`` (an off-policy REINFORCE with a truncated weight); the value of
the loss is not a surrogate of the return, only its gradient is. Choices: the log-ratio is clamped to [-20, 20]
before ``exp``, as verl's ``compute_policy_loss_cispo``; ``clip_low = 10`` leaves the weight unbounded below, as
the paper (which imposes no lower bound) and verl's CISPO example do; ``clip_high = 0.2`` is that example's;
token-mean aggregation, as the paper's token-level normalisation. Figures: ``clip_frac_low`` / ``clip_frac_high``,
the fractions of sampled tokens whose weight was clipped below / above (their sum is verl's ``pg_clipfrac``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrl.algo.losses import aggregate
from ctxrl.algo.policy_losses.base import finish, masked_mean, ratio_figures, register_policy_loss
from ctxrl.settings import NON_NEGATIVE


@dataclass(frozen=True)
class CISPOSettings:
    """``[algo.cispo]``: the range the importance weight is clipped to, ``[1 - clip_low, 1 + clip_high]``."""

    clip_low: float = field(default=10.0, metadata=NON_NEGATIVE)
    """Lower clip of the weight (10: none, as the paper)."""
    clip_high: float = field(default=0.2, metadata=NON_NEGATIVE)
    """Upper clip of the weight."""


@register_policy_loss("cispo", settings=CISPOSettings)
def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
               clip_low: float = 10.0, clip_high: float = 0.2, agg: str = "token-mean",
               norm_length: float | None = None, denominator: float | None = None,
               token_weights: torch.Tensor | None = None, on_device: bool = False) -> tuple[torch.Tensor, dict]:
    """CISPO (module docstring).

    logprobs, old_logprobs, advantages, mask: [B,T]  ->  (scalar loss, metrics)
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    per_token = -weight * advantages * logprobs
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, mask, agg, norm_length=norm_length, denominator=denominator)
    metrics = {**ratio_figures(logprobs, old_logprobs, mask),
               "clip_frac_low": masked_mean((ratio < 1.0 - clip_low).to(ratio.dtype), mask),
               "clip_frac_high": masked_mean((ratio > 1.0 + clip_high).to(ratio.dtype), mask)}
    return loss, finish(metrics, on_device)
