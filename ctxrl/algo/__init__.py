"""Advantages, returns, losses, KL estimators and aggregation: pure functions over tensors and masks."""

from ctxrl.algo.advantages import grpo_advantages, rloo_advantages
from ctxrl.algo.losses import AGG_MODES, aggregate, entropy_from_logits, gspo_loss, kl_penalty, policy_loss
from ctxrl.algo.returns import gae_advantages, masked_mean, masked_whiten, reinforce_pp_returns
from ctxrl.algo.turns import broadcast_turn_advantages, turn_advantages, turn_loo_advantages, turn_returns

__all__ = [
    "AGG_MODES", "aggregate", "broadcast_turn_advantages", "entropy_from_logits", "gae_advantages",
    "grpo_advantages", "gspo_loss", "kl_penalty", "masked_mean", "masked_whiten", "policy_loss",
    "reinforce_pp_returns", "rloo_advantages", "turn_advantages", "turn_loo_advantages", "turn_returns",
]
