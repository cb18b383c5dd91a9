"""The critic's loss for PPO with GAE: a clipped value regression over sampled tokens.

``value_loss(values, old_values, returns, mask, clip)``: per token
``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` (the PPO2 / verl clipped value
loss: a value prediction may not move more than ``c`` from the one the advantages were computed
with, unless that makes it worse), aggregated like the policy loss.
"""

from __future__ import annotations

import torch

from ctxrl.algo.losses import aggregate


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float = 0.2, agg: str = "token-mean", denominator: float | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss and metrics (clip fraction, explained variance).

    values, old_values, returns, mask: [B,T]  ->  (scalar loss, metrics)
    """
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    plain_err = (values - returns) ** 2
    clipped_err = (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(plain_err, clipped_err)
    loss = aggregate(per_token, mask, agg, denominator=denominator)
    with torch.no_grad():
        m = mask.to(values.dtype)
        n = m.sum().clamp(min=1.0)
        r_mean = (returns * m).sum() / n
        var_r = (((returns - r_mean) ** 2) * m).sum() / n
        var_e = (((returns - values) ** 2) * m).sum() / n
        metrics = {"vf_clip_frac": float(((clipped_err > plain_err).to(m.dtype) * m).sum() / n),
                   "vf_explained_var": float(1.0 - var_e / var_r) if var_r > 0 else 0.0}
    return loss, metrics
