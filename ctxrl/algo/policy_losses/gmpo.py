"""GMPO: maximise the geometric mean of the token ratios instead of their arithmetic mean (Zhao et al. 2025,
"Geometric-Mean Policy Optimization", arXiv 2507.20673).

GRPO's token-mean of ``r_t A`` lets one token with an extreme ratio dominate a sequence's update. GMPO scores a
sequence ``i`` of ``n_i`` sampled tokens by the geometric mean of its clipped token ratios:

    loss_i = -A_i * exp( (1/n_i) sum_t sgn(A_i) * min(sgn(A_i) * d_t, sgn(A_i) * clip(d_t, -clip_low, clip_high)) )

with ``d_t = log pi(y_t) - log pi_old(y_t)``: the clip is on the log-ratio (token-level, and wider than PPO's:
the paper's and verl's example's ``clip_low = clip_high = 0.4``, i.e. ratios in ``(e^-0.4, e^0.4)``), and the
``min`` binds it only on the side that would increase the objective, as PPO's does. ``A_i`` is the mean advantage
of the sequence's sampled tokens (GMPO is defined for one advantage per sequence, as verl's
``compute_policy_loss_geo_mean``). The loss is the mean of ``loss_i`` over sequences (so ``agg`` must be
``seq-mean-token-mean``, the reduction GMPO has, and ``denominator`` counts sequences); the log-ratio is not
clamped before ``exp`` (verl leaves that clamp commented out). ``token_weights`` enter per sequence as their
geometric mean (``exp(mean_t log(w_t + 1e-10))``, as verl aggregates rollout-correction weights for this loss; a
rejected token therefore does not zero its sequence: reject through the mask).

Differences from verl: verl's mean runs over every row, including rows with no sampled token; here such rows
never enter the denominator (as everywhere in ctxrl). Figures: ``clip_frac_high`` / ``clip_frac_low``, the
fractions of sampled tokens with ``A > 0`` / ``A < 0`` whose log-ratio is outside the clip range (verl's
``pg_clipfrac`` / ``pg_clipfrac_lower``), and ``seq_ratio_mean``, the mean clipped geometric ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrl.algo.policy_losses.base import FIGURES, finish, masked_mean, ratio_figures, register_policy_loss
from ctxrl.settings import NON_NEGATIVE


@dataclass(frozen=True)
class GMPOSettings:
    """``[algo.gmpo]``: the clip range of each token's log-ratio, ``[-clip_low, clip_high]``."""

    clip_low: float = field(default=0.4, metadata=NON_NEGATIVE)
    """Lower clip of the log-ratio."""
    clip_high: float = field(default=0.4, metadata=NON_NEGATIVE)
    """Upper clip of the log-ratio."""


@register_policy_loss("gmpo", settings=GMPOSettings, figures=(*FIGURES, "seq_ratio_mean"),
                      aggregations=("seq-mean-token-mean",))
def gmpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_low: float = 0.4, clip_high: float = 0.4, agg: str = "seq-mean-token-mean",
              norm_length: float | None = None, denominator: float | None = None,
              token_weights: torch.Tensor | None = None, on_device: bool = False) -> tuple[torch.Tensor, dict]:
    """GMPO (module docstring).

    logprobs, old_logprobs, advantages, mask: [B,T]  ->  (scalar loss, metrics)
    """
    if agg != "seq-mean-token-mean":
        raise ValueError(f"GMPO's objective is a mean over sequences of a geometric mean over their tokens; "
                         f"algo.agg must be seq-mean-token-mean, got {agg!r}")
    m = mask.to(logprobs.dtype)
    tokens = m.sum(-1)
    live = (tokens > 0).to(m.dtype)
    log_ratio = logprobs - old_logprobs
    sign = torch.sign(advantages)
    clipped = torch.clamp(log_ratio, -clip_low, clip_high)
    bound = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_ratio = torch.exp((bound * m).sum(-1) / tokens.clamp(min=1.0))
    seq_advantage = (advantages * m).sum(-1) / tokens.clamp(min=1.0)
    per_sequence = -seq_advantage * seq_ratio
    if token_weights is not None:
        log_weights = torch.log(token_weights.detach() + 1e-10)
        per_sequence = per_sequence * torch.exp((log_weights * m).sum(-1) / tokens.clamp(min=1.0))
    count = live.sum() if denominator is None else torch.as_tensor(float(denominator), dtype=m.dtype)
    loss = (per_sequence * live).sum() / count.clamp(min=1.0)
    outside = (log_ratio != clipped).to(m.dtype)
    metrics = {**ratio_figures(logprobs, old_logprobs, mask),
               "clip_frac_high": masked_mean(outside * (advantages > 0), mask),
               "clip_frac_low": masked_mean(outside * (advantages < 0), mask),
               "seq_ratio_mean": (seq_ratio * live).sum() / live.sum().clamp(min=1.0)}
    return loss, finish(metrics, on_device)
