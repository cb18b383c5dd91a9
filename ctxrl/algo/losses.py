"""Policy losses, KL estimators and loss aggregation: pure functions over explicit masks.

Shapes: ``B`` sequences of ``T`` tokens. ``mask[B,T]`` is 1 on tokens the policy sampled (the
loss mask) and 0 on prompt, template and tool-output tokens. Nothing here holds state.
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
LOSSES = ("ppo_clip", "gspo")
"""The two policy losses defined here: token-ratio PPO-clip (``policy_loss``) and sequence-ratio GSPO
(``gspo_loss``). Every loss ``algo.loss`` may name is in the registry, ``ctxrl.algo.policy_losses``."""
OLD_LOGPROBS = ("behaviour", "recompute")
"""Where the PPO "old" policy's log-probs come from: the sampler's, or one learner pass before the update."""


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
              norm_length: float | None = None, denominator: float | None = None) -> torch.Tensor:
    """Reduce per-token ``values[B,T]`` to a scalar over ``mask[B,T]``.

    - ``token-mean``: sum over all mask-1 tokens / their count (DAPO's token-level loss);
    - ``seq-mean-token-sum``: per sequence sum, mean over sequences;
    - ``seq-mean-token-mean``: per sequence mean, mean over sequences (original GRPO);
    - ``seq-mean-token-sum-norm``: per sequence sum / ``norm_length`` (a constant: the most
      tokens a response can have), mean over sequences (Dr.GRPO).

    Sequences with no mask-1 token never enter a denominator; an all-masked input gives 0.
    ``denominator`` replaces the count in the outer mean (tokens for ``token-mean``, sequences
    otherwise): under gradient accumulation pass the count of the whole mini-batch so that the
    micro-batch losses add up to exactly the mini-batch loss.
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        count = mask.sum() if denominator is None else torch.as_tensor(float(denominator))
        return (values * mask).sum() / count.clamp(min=1.0)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation {mode!r}; choose one of {', '.join(AGG_MODES)}")
    per_seq_tokens = mask.sum(-1)
    live = per_seq_tokens > 0
    sums = (values * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        per_seq = sums
    elif mode == "seq-mean-token-mean":
        per_seq = sums / per_seq_tokens.clamp(min=1.0)
    else:
        if not norm_length:
            raise ValueError("seq-mean-token-sum-norm needs norm_length (e.g. the max response length)")
        per_seq = sums / float(norm_length)
    count = live.sum().to(values.dtype) if denominator is None else torch.as_tensor(float(denominator))
    return (per_seq * live).sum() / count.clamp(min=1.0)



@torch.no_grad()
def _clip_metrics(logprobs, old_logprobs, ratio, advantages, mask, clip_low: float, clip_high: float,
                  on_device: bool = False) -> dict[str, float]:
    """Fractions of sampled tokens clipped below / above, approx KL (``0.5 (log r)^2``), mean ratio.

    ``on_device``: 0-d tensors where they were computed, so a training loop reads them once per step
    rather than waiting for the device four times per micro-batch."""
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    low = ((ratio < 1.0 - clip_low) & (advantages < 0)).float()
    high = ((ratio > 1.0 + clip_high) & (advantages > 0)).float()
    out = {
        "clip_frac_low": (low * m).sum() / n,
        "clip_frac_high": (high * m).sum() / n,
        "approx_kl": (0.5 * (logprobs - old_logprobs) ** 2 * m).sum() / n,
        "ratio_mean": (ratio * m).sum() / n,
    }
    return out if on_device else {k: float(v) for k, v in out.items()}


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip: float | None = None, agg: str = "token-mean", norm_length: float | None = None,
                denominator: float | None = None, token_weights: torch.Tensor | None = None,
                on_device: bool = False
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy loss (Schulman et al. 2017) with clip-higher (DAPO) and dual clip (Ye et al. 2020).

    ``ratio = exp(logprobs - old_logprobs)``; per token
    ``loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``; with ``dual_clip = c``
    (> 1) the loss of negative-advantage tokens is further capped at ``-c * A`` (None or 0: no dual clip).
    ``token_weights`` (no gradient) multiply each token's loss before aggregation, e.g. truncated
    importance weights between the learner's and the sampler's old policy.

    logprobs, old_logprobs, advantages, mask: [B,T]  ->  (scalar loss, metrics)
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        capped = torch.minimum(per_token, -advantages * dual_clip)
        per_token = torch.where(advantages < 0, capped, per_token)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, mask, agg, norm_length=norm_length, denominator=denominator)
    return loss, _clip_metrics(logprobs, old_logprobs, ratio, advantages, mask, clip_low, clip_high, on_device)



def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              *, clip_low: float = 3e-4, clip_high: float = 4e-4, agg: str = "seq-mean-token-mean",
              norm_length: float | None = None, denominator: float | None = None,
              token_weights: torch.Tensor | None = None,
              on_device: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: sequence-level importance ratios (Zheng et al. 2025, "Group Sequence Policy Optimization").

    ``s_i = exp(mean_t (logprobs - old_logprobs))`` over sequence ``i``'s mask-1 tokens (the
    length-normalised sequence ratio), clipped at ``[1 - clip_low, 1 + clip_high]`` (the paper
    uses 3e-4 / 4e-4). Written in the token form ``s_{i,t} = sg(s_i) * p_t / sg(p_t)``, whose value
    is ``s_i`` at every token and whose gradient, averaged over the sequence's tokens, is the
    gradient of ``s_i``; so with ``agg="seq-mean-token-mean"`` this is the paper's objective, and
    token-varying advantages give GSPO-token. The log sequence ratio is capped at 10 before
    ``exp``, as in verl's ``compute_policy_loss_gspo``.

    logprobs, old_logprobs, advantages, mask: [B,T]  ->  (scalar loss, metrics)
    """
    m = mask.to(logprobs.dtype)
    delta = (logprobs - old_logprobs) * m
    seq_log_ratio = delta.sum(-1) / m.sum(-1).clamp(min=1.0)
    log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio.clamp(max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, mask, agg, norm_length=norm_length, denominator=denominator)
    return loss, _clip_metrics(logprobs, old_logprobs, ratio, advantages, mask, clip_low, clip_high, on_device)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimators of KL(policy || reference) from sampled-token log-probs (Schulman 2020).

    ``k1 = log r`` with ``log r = logprobs - ref_logprobs``; ``k2 = (log r)^2 / 2``;
    ``k3 = exp(-log r) - 1 + log r`` (unbiased, low variance, always >= 0), with ``log r`` clamped
    to [-20, 20] and the result to [-10, 10] as in verl.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    if kind == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.clamp(torch.exp(-log_ratio) - 1.0 + log_ratio, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")


def entropy_from_logits(logits: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of each position's softmax, computed in chunks of positions to bound memory.

    logits: [..., V]  ->  [...]
    """
    flat = logits.reshape(-1, logits.shape[-1])
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start:start + chunk_size].to(dtype)
        logp = torch.log_softmax(chunk, dim=-1)
        out[start:start + chunk_size] = -(logp.exp() * logp).sum(-1)
    return out.reshape(logits.shape[:-1])
