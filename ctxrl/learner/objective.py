"""What the learner minimises on one micro-batch, and the figures it reports of it.

``micro_batch_objective`` assembles the loss: the policy loss ``algo.loss`` names (a registered function,
``ctxrl.algo.policy_losses``, called with its own settings) over the micro-batch's sampled tokens (weighted by
truncated importance sampling when the old log-probs are recomputed), minus the entropy bonus, plus the KL to the
reference and the distillation teacher's top-K term, each aggregated with the whole mini-batch's denominator (exact
gradient accumulation: ``ctxrl.learner.learner``), plus ECHO's world-model cross-entropy on the environment's tokens
(``algo.world_model_coef``, ``ctxrl.algo.world_model``) over the mini-batch's environment tokens.
``critic_objective`` is the critic's clipped value loss. Both add
their figures to the mini-batch's sums, on the device; ``mini_batch_metrics`` turns the sums into the step's row, and
``figure_keys`` names the sums a mini-batch has (data parallelism sums them across ranks, absent ones as 0).

It runs no backward pass and owns no optimiser (``Learner`` does both).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ctxrl.algo.distill import topk_forward_kl
from ctxrl.algo.losses import aggregate, kl_penalty
from ctxrl.learner.batch import Batch
from ctxrl.learner.forward import Forward

if TYPE_CHECKING:
    from ctxrl.learner.settings import LearnerSettings

LAYOUT_KEYS = ("learner_micro_batches", "learner_flat_forward", "learner_shared_prefix_rows",
               "learner_shared_prefix_saved_tokens")
"""Figures of an update that say how this process ran it (micro-batches an epoch, the flat pass or not, rows an
epoch run inside shared-prefix trees and the tokens those trees did not recompute: ``train.shared_prefix``), not
what it computed: under data parallelism each rank reports its own share's."""


def add(sums: dict, key: str, value) -> None:
    """``sums[key] += value`` (from 0)."""
    sums[key] = sums.get(key, 0.0) + value


def micro_batch_objective(forward: Forward, s: LearnerSettings, micro: Batch, sums: dict, *, reference,
                          denominator: float, norm_length: float, env_tokens: float = 0.0) -> torch.Tensor:
    """The loss of ``micro`` under the policy ``forward`` and settings ``s`` (the module docstring), ``reference`` the
    KL reference (or None); its figures are added to ``sums``. ``env_tokens``: the mini-batch's environment tokens,
    the world-model loss's denominator."""
    a = s.algo
    world_model = a.world_model_coef > 0 and micro.env_mask is not None
    scored = micro
    if world_model:  # one pass scores the sampled and the environment's tokens; each term reads its own
        scored = dataclasses.replace(micro, loss_mask=torch.maximum(micro.loss_mask, micro.env_mask))
    old, weights = old_logprobs_and_weights(micro, a, sums)
    topk = s.distill_top_k_coef > 0 and micro.teacher_ids is not None
    entropy_grad = a.entropy_coef > 0
    if topk:
        logprobs, entropy, student_topk = forward.logprobs(scored, with_entropy=True, entropy_grad=entropy_grad,
                                                           extra_ids=micro.teacher_ids)
    else:
        logprobs, entropy = forward.logprobs(scored, with_entropy=True, entropy_grad=entropy_grad)
    if world_model:
        from ctxrl.algo.world_model import world_model_loss

        env_loss, env_figures = world_model_loss(logprobs, micro.env_mask, coef=a.world_model_coef,
                                                 denominator=max(env_tokens, 1.0), on_device=True)
        add(sums, "world_model_nll", env_figures["env_nll"].detach() * env_figures["env_tokens"])
        add(sums, "world_model_tokens", env_figures["env_tokens"])
        sampled = micro.loss_mask.bool()
        logprobs = torch.where(sampled, logprobs, logprobs.new_zeros(()))
        entropy = torch.where(sampled, entropy, entropy.new_zeros(()))
    loss, m = s.policy_loss(logprobs, old, micro.advantages, micro.loss_mask, agg=a.agg, norm_length=norm_length,
                            denominator=denominator, token_weights=weights, on_device=True, **s.loss_keywords)
    if a.entropy_coef > 0:
        loss = loss - a.entropy_coef * aggregate(entropy, micro.loss_mask, a.agg, norm_length=norm_length,
                                                 denominator=denominator)
    if s.kl_coef > 0 and reference is not None:
        ref = reference.logprobs(micro.input_ids, micro.attention_mask, temperature=s.temperature,
                                 mask=micro.loss_mask, chunk=s.train.logprob_chunk_tokens)
        kl = kl_penalty(logprobs, ref, a.kl_kind)
        loss = loss + s.kl_coef * aggregate(kl, micro.loss_mask, a.agg, norm_length=norm_length,
                                            denominator=denominator)
        add(sums, "kl", (kl.detach() * micro.loss_mask).sum())
    if topk:
        forward_kl = topk_forward_kl(micro.teacher_probs, student_topk, micro.loss_mask)
        loss = loss + s.distill_top_k_coef * aggregate(forward_kl, micro.loss_mask, a.agg, norm_length=norm_length,
                                                       denominator=denominator)
        add(sums, "distill_topk_kl", forward_kl.detach().sum())
    if world_model:
        loss = loss + env_loss
    # Figures stay on the device (0-d tensors) until the mini-batch ends: one host sync, not eight per micro-batch.
    with torch.no_grad():
        n_tok = micro.loss_mask.sum()
        add(sums, "loss", loss.detach())
        add(sums, "entropy", (entropy.detach() * micro.loss_mask).sum())
        add(sums, "logprob_mismatch", ((logprobs.detach() - old).abs() * micro.loss_mask).sum())
        for key in s.figures:
            add(sums, key, m[key] * n_tok)
    return loss


def old_logprobs_and_weights(micro: Batch, a, sums: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The old log-probs the ratio is taken against (the rollout's, or the learner's recomputed ones) and each token's
    off-policy weight (None: none), its figures added to ``sums``."""
    if a.old_logprobs != "recompute":
        return micro.old_logprobs, None
    weights = None
    if a.tis_cap:
        # Yao et al. 2025: weight by the (truncated) learner/behaviour ratio of the old policy
        raw = torch.exp(micro.recomputed - micro.old_logprobs) * micro.loss_mask
        weights = raw.clamp(max=a.tis_cap)
        add(sums, "tis_weight", weights.detach().sum())
        add(sums, "tis_truncated", ((raw > a.tis_cap).float() * micro.loss_mask).sum())
    elif micro.offpolicy_weights is not None:  # (algo.offpolicy: once per update, ``offpolicy_correction``)
        weights = micro.offpolicy_weights
    return micro.recomputed, weights


def offpolicy_correction(batch: Batch, s: LearnerSettings) -> tuple[Batch, dict[str, float]]:
    """``batch`` corrected by the off-policy correction ``algo.offpolicy`` names, and its figures (``offpolicy_*``).

    It compares the learner's recomputed old log-probs with the behaviour ones, the sampler's (a bf16 engine, or an
    older policy under bounded staleness: the same path either way), once per update over the whole batch, so a
    sequence-level rejection sees whole sequences and M2PO's second moment the whole batch. The batch comes back with
    the correction's loss mask (a rejected sequence leaves the loss and its denominators) and its weights, which
    multiply each token's policy loss (``micro_batch_objective``)."""
    from ctxrl.algo.offpolicy import get_offpolicy_correction

    correct = get_offpolicy_correction(s.algo.offpolicy)
    out = correct(batch.recomputed, batch.old_logprobs, batch.loss_mask, advantages=batch.advantages,
                  **s.offpolicy_keywords)
    corrected = dataclasses.replace(batch, loss_mask=out.loss_mask.to(batch.loss_mask.dtype),
                                    offpolicy_weights=out.weights.to(batch.old_logprobs.dtype))
    return corrected, {f"offpolicy_{k}": float(v) for k, v in out.metrics.items()}


def critic_objective(critic, s: LearnerSettings, micro: Batch, sums: dict, *, denominator: float) -> torch.Tensor:
    """The critic's clipped value loss of ``micro`` (token-mean over the mini-batch's ``denominator`` value
    positions); its figures are added to ``sums``."""
    from ctxrl.algo.value import value_loss

    mask = micro.loss_mask if micro.value_mask is None else micro.value_mask
    values = critic(micro.input_ids, micro.attention_mask)
    loss, m = value_loss(values, micro.old_values, micro.returns, mask, clip=s.vf_clip, denominator=denominator)
    n_tok = float(mask.sum())
    add(sums, "vf_loss", float(loss.detach()))
    add(sums, "vf_count", n_tok)
    for key in ("vf_clip_frac", "vf_explained_var"):
        add(sums, key, m[key] * n_tok)
    return loss


def figure_keys(s: LearnerSettings, *, kl: bool, critic: bool) -> list[str]:
    """The sums a mini-batch accumulates under settings ``s`` (``micro_batch_objective``, ``critic_objective``);
    ``kl``: the learner has a reference, ``critic``: a critic."""
    keys = ["loss", "entropy", "logprob_mismatch", *s.figures]
    if s.algo.old_logprobs == "recompute" and s.algo.tis_cap:
        keys += ["tis_weight", "tis_truncated"]
    if s.kl_coef > 0 and kl:
        keys.append("kl")
    if s.distill_top_k_coef > 0:
        keys.append("distill_topk_kl")
    if s.algo.world_model_coef > 0:
        keys += ["world_model_nll", "world_model_tokens"]
    if critic:
        keys += ["vf_loss", "vf_count", "vf_clip_frac", "vf_explained_var"]
    return keys


def mini_batch_metrics(sums: dict[str, float], tokens: float, figures: tuple[str, ...]) -> dict[str, float]:
    """A mini-batch's figures from its sums (one host transfer): per sampled token (the policy loss's ``figures``
    among them), the critic's per value position."""
    on_device = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    if on_device:  # one transfer for all of them
        values = torch.stack([sums[k].detach().double().reshape(()) for k in on_device]).tolist()
        sums = {**sums, **dict(zip(on_device, values))}
    out = {"loss": sums["loss"]}
    if "vf_loss" in sums:
        out["vf_loss"] = sums["vf_loss"]
    for key in dict.fromkeys(("entropy", "logprob_mismatch", *figures, "kl", "tis_weight", "tis_truncated",
                              "distill_topk_kl")):
        if key in sums:
            out[key] = sums[key] / max(tokens, 1.0)
    for key in ("vf_clip_frac", "vf_explained_var"):
        if key in sums:
            out[key] = sums[key] / max(sums["vf_count"], 1.0)
    if "world_model_nll" in sums:  # per environment token
        out["world_model_nll"] = sums["world_model_nll"] / max(sums["world_model_tokens"], 1.0)
    return out
