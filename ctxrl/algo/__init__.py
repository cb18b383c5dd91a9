"""Advantages, losses, KL estimators and aggregation: pure functions over tensors and masks."""

from ctxrl.algo.advantages import grpo_advantages
from ctxrl.algo.losses import AGG_MODES, aggregate, entropy_from_logits, kl_penalty, policy_loss

__all__ = ["AGG_MODES", "aggregate", "entropy_from_logits", "grpo_advantages", "kl_penalty", "policy_loss"]
