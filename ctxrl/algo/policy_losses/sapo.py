"""SAPO: a smooth, temperature-controlled gate in place of the hard clip (Gao et al. 2025, "Soft Adaptive Policy
Optimization", arXiv 2511.20347).

Per token, with ``r_t = exp(log pi - log pi_old)``,

    loss_t = -f(r_t) * A_t,    f(r) = sigmoid(tau * (r - 1)) * 4 / tau,    tau = tau_pos if A_t > 0 else tau_neg

``f`` has slope 1 at ``r = 1`` (on-policy it is the plain policy gradient) and its gradient weight relative to the
unclipped ``r A grad log pi``, ``4 s (1 - s)`` with ``s = sigmoid(tau (r - 1))``, decays smoothly as ``r`` leaves 1
instead of dropping to 0 at a clip boundary. A larger ``tau_neg`` (1.05 against 1.0, the paper's and verl's
defaults) damps negative-advantage tokens faster, where off-policy updates are least stable. Choices as verl's
``compute_policy_loss_sapo``: log-ratio clamped to [-20, 20]; ``A = 0`` takes ``tau_neg``; the default aggregation
is ``seq-mean-token-mean`` (verl forces it; here it is a default). Figure: ``soft_clip_weight``, the mean of
``4 s (1 - s)`` over sampled tokens (1: nothing damped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrl.algo.losses import aggregate
from ctxrl.algo.policy_losses.base import finish, masked_mean, ratio_figures, register_policy_loss
from ctxrl.settings import POSITIVE


@dataclass(frozen=True)
class SAPOSettings:
    """``[algo.sapo]``: the gate's temperatures."""

    tau_pos: float = field(default=1.0, metadata=POSITIVE)
    """Temperature of positive-advantage tokens."""
    tau_neg: float = field(default=1.05, metadata=POSITIVE)
    """Temperature of negative-advantage tokens (and A = 0); larger damps them faster."""


@register_policy_loss("sapo", settings=SAPOSettings, figures=("approx_kl", "soft_clip_weight"))
def sapo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              tau_pos: float = 1.0, tau_neg: float = 1.05, agg: str = "seq-mean-token-mean",
              norm_length: float | None = None, denominator: float | None = None,
              token_weights: torch.Tensor | None = None, on_device: bool = False) -> tuple[torch.Tensor, dict]:
    """SAPO (module docstring).

    logprobs, old_logprobs, advantages, mask: [B,T]  ->  (scalar loss, metrics)
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO's temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=ratio.dtype),
                      torch.as_tensor(tau_neg, dtype=ratio.dtype))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -gate * (4.0 / tau) * advantages
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, mask, agg, norm_length=norm_length, denominator=denominator)
    metrics = {**ratio_figures(logprobs, old_logprobs, mask),
               "soft_clip_weight": masked_mean(4.0 * gate.detach() * (1.0 - gate.detach()), mask)}
    return loss, finish(metrics, on_device)
