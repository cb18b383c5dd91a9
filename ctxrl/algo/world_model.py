"""An optional loss on environment tokens: ECHO's world-model cross-entropy (Shrivastava et al. 2026, "Terminal
agents learn world models for free", arXiv 2605.24517; ECHO = Environment Cross-entropy Hybrid Objective).

Agent RL masks the environment's replies (tool output) out of the loss and learns from its actions' sparse
rewards only. The model already computes the log-probability of every reply token in the same forward pass;
ECHO adds the next-token cross-entropy on them, which teaches the policy to predict what the environment answers
to its actions, and turns every rollout, failed ones included, into dense supervision:

    L = L_policy(sampled tokens) + coef * mean_{environment tokens} ( -log pi(y_t | y_<t) )

Choices: ``coef`` is separate from every policy setting (the paper's 0.05; 0 leaves the policy loss unchanged);
the cross-entropy is averaged over the environment tokens with its own denominator (``agg`` over ``env_mask``, as
prime-rl normalises it apart from the policy tokens, so the reply tokens never dilute the policy loss's
normalisation; ``seq-mean-token-mean`` gives rLLM's per-sequence mean); it is the plain log-likelihood of the
observed tokens (no importance weight: they were not sampled by the policy). The policy loss stays on the loss
mask, which is 0 on environment tokens; ``policy_mask``, when given, is checked to share no token with
``env_mask``, so a token can never be trained both as an action and as an observation.

``env_mask`` must come from where the tokens are born (the rollout recorder knows which tokens an environment
wrote), never rebuilt from text: ``ctxrl.types.environment_mask``, carried by ``TrainSequence.env_mask`` into
``Batch.env_mask``; the learner adds this loss under ``algo.world_model_coef`` (``ctxrl.learner.objective``).
"""

from __future__ import annotations

import torch

from ctxrl.algo.losses import aggregate


def world_model_loss(logprobs: torch.Tensor, env_mask: torch.Tensor, *, coef: float = 0.05,
                     policy_mask: torch.Tensor | None = None, agg: str = "token-mean",
                     norm_length: float | None = None, denominator: float | None = None,
                     on_device: bool = False) -> tuple[torch.Tensor, dict]:
    """``coef`` times the mean negative log-likelihood of the environment tokens (module docstring).

    logprobs: [B,T] the model's log-probability of each actual token given its prefix (every position, not only
    sampled ones); env_mask: [B,T] 1 on environment (tool-output) tokens; policy_mask: [B,T] the policy's loss
    mask (optional check)  ->  (scalar loss, metrics: ``env_nll`` the mean NLL per environment token,
    ``env_tokens`` their count)
    """
    if logprobs.shape != env_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and env_mask {tuple(env_mask.shape)} must be equal")
    if coef < 0:
        raise ValueError(f"the world-model coefficient must be >= 0, got {coef}")
    if policy_mask is not None and bool((policy_mask.bool() & env_mask.bool()).any()):
        raise ValueError("env_mask and the policy's loss mask share tokens; a token is either sampled by the policy "
                         "or written by the environment (build env_mask where the tokens are recorded)")
    nll = torch.where(env_mask.bool(), -logprobs, 0.0)
    loss = coef * aggregate(nll, env_mask, agg, norm_length=norm_length, denominator=denominator)
    with torch.no_grad():
        m = env_mask.to(nll.dtype)
        metrics = {"env_nll": (nll.detach() * m).sum() / m.sum().clamp(min=1.0), "env_tokens": m.sum()}
    return loss, metrics if on_device else {k: float(v) for k, v in metrics.items()}
