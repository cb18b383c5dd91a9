"""Token-level returns and advantages: REINFORCE++ returns, GAE, masked whitening.

Shapes: ``B`` sequences of ``T`` tokens; ``mask[B,T]`` is the loss mask (1 on sampled tokens).
Multi-turn rule, the same for every function here: a mask-0 token (prompt, template, tool
output, padding) is *not a step of the policy*. Its reward and value are ignored, it is not
discounted over, and recursions carry straight across it, so the observation a tool returned
can never leak into an advantage. Outputs are 0 at mask-0 positions.

Where this differs from verl's ``core_algos.py`` (the reference we check parity against):
verl's REINFORCE++ resets the running return at mask-0 tokens (right for one response followed
by padding, wrong across a tool observation) and leaves carried values at mask-0 positions;
on single-turn inputs (sampled tokens, then padding) both agree at every mask-1 position.
"""

from __future__ import annotations

import torch


def _check(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if x.shape != mask.shape or x.dim() != 2:
        raise ValueError(f"{name} {tuple(x.shape)} and mask {tuple(mask.shape)} must be equal [B, T] shapes")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over mask-1 entries (0 when there are none)."""
    live = mask.bool()
    return torch.where(live, x, 0.0).sum() / live.sum().to(x.dtype).clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and Bessel-corrected variance over mask-1 entries.

    ``shift_mean=False`` adds the mean back (scale only). Mask-0 entries come out as 0. With a
    single mask-1 entry the variance is taken as 0 (not NaN). As verl's ``masked_whiten``.

    x, mask: [B,T]  ->  [B,T]
    """
    _check("x", x, mask)
    live = mask.bool()
    x = torch.where(live, x, 0.0)
    n = live.sum().to(x.dtype)
    mean = x.sum() / n.clamp(min=1.0)
    var = torch.where(live, (x - mean) ** 2, 0.0).sum() / (n - 1.0).clamp(min=1.0)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(live, out, 0.0)


def reinforce_pp_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted returns over sampled tokens (REINFORCE++, Hu 2025), carried across mask-0 spans.

    For the sampled tokens ``t_1 < ... < t_K`` of a sequence,
    ``G(t_k) = r(t_k) + gamma * G(t_{k+1})`` with ``G(t_{K+1}) = 0``. Rewards on mask-0 tokens
    are ignored; put a turn's reward on its last sampled token (the end-of-turn token). The
    REINFORCE++ advantage is ``masked_whiten(returns, mask)`` over the batch.

    token_rewards, mask: [B,T]  ->  returns [B,T] (0 at mask-0)
    """
    _check("token_rewards", token_rewards, mask)
    rewards = token_rewards.float()
    live_mask = mask.bool()
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        live = live_mask[:, t]
        running = torch.where(live, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(live, running, 0.0)
    return returns


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over sampled tokens only.

    With ``t_1 < ... < t_K`` the mask-1 positions of a sequence and ``V(t_{K+1}) = 0``:
    ``delta_k = r(t_k) + gamma * V(t_{k+1}) - V(t_k)``, ``A_k = delta_k + gamma * lam * A_{k+1}``,
    ``returns = A + V``. Values and rewards at mask-0 positions never enter (the next value
    seen from the last token of a turn is the value of the next turn's first sampled token).
    Not whitened: whiten with ``masked_whiten`` if wanted.

    token_rewards, values, mask: [B,T]  ->  (advantages [B,T], returns [B,T]), 0 at mask-0
    """
    _check("token_rewards", token_rewards, mask)
    _check("values", values, mask)
    rewards, values = token_rewards.float(), values.float()
    live_mask = mask.bool()
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        live = live_mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = torch.where(live, delta + gamma * lam * next_adv, next_adv)
        next_value = torch.where(live, values[:, t], next_value)
        advantages[:, t] = torch.where(live, next_adv, 0.0)
    returns = torch.where(live_mask, advantages + values, 0.0)
    return advantages, returns
