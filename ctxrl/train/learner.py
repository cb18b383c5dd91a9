"""The learner: batches episodes into tensors, recomputes log-probs, and applies PPO updates.

Token alignment: for a sequence ``x[0..T)``, position ``t`` of the shifted tensors predicts token
``x[t+1]`` from logits at ``t``. So ``loss_mask``, behaviour log-probs and advantages are taken
from ``[1:]`` of the episode's lists, and logits from ``[:-1]``.

Gradient accumulation is exact: each mini-batch's loss is normalised by the mini-batch's total
count (mask-1 tokens for ``token-mean``, live sequences for the ``seq-mean-*`` modes), not by each
micro-batch's, so splitting a mini-batch into micro-batches of uneven lengths changes neither the
loss nor the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ctxrl.algo.losses import aggregate, entropy_from_logits, gspo_loss, kl_penalty, policy_loss
from ctxrl.models.kernels import attention_kernels
from ctxrl.types import Episode


@dataclass
class Batch:
    """Right-padded, shifted tensors for a list of episodes (all [B, T-1] but ``input_ids``)."""

    input_ids: torch.Tensor      # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor        # [B, T-1]
    loss_mask: torch.Tensor      # [B, T-1] float
    old_logprobs: torch.Tensor   # [B, T-1]
    advantages: torch.Tensor     # [B, T-1]


def collate(episodes: list[Episode], pad_token_id: int, device: torch.device | str = "cpu",
            advantages: list[float] | list[list[float]] | None = None) -> Batch:
    """Pad and shift ``episodes``; ``advantages`` is one float per episode (broadcast over its
    sampled tokens) or one list per episode aligned with its ``input_ids``."""
    width = max(len(e.input_ids) for e in episodes)
    n = len(episodes)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width))
    old = torch.zeros((n, width))
    for row, ep in enumerate(episodes):
        length = len(ep.input_ids)
        ids[row, :length] = torch.tensor(ep.input_ids)
        attn[row, :length] = 1
        mask[row, :length] = torch.tensor(ep.loss_mask, dtype=torch.float32)
        old[row, :length] = torch.tensor(ep.behavior_logprobs, dtype=torch.float32)
    adv = torch.zeros((n, width))
    if advantages is not None:
        if len(advantages) != n:
            raise ValueError(f"collate: {len(advantages)} advantages for {n} episodes")
        for row, (ep, a) in enumerate(zip(episodes, advantages)):
            if isinstance(a, (int, float)):
                adv[row] = float(a)
            elif len(a) != len(ep.input_ids):
                raise ValueError(f"collate: episode {row} has {len(ep.input_ids)} tokens but {len(a)} advantages")
            else:
                adv[row, : len(a)] = torch.tensor(a, dtype=torch.float32)
    adv = adv * mask
    return Batch(ids.to(device), attn.to(device), ids[:, 1:].to(device), mask[:, 1:].to(device),
                 old[:, 1:].to(device), adv[:, 1:].to(device))


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                   return_logits: bool = False):
    """Log-probs [B, T-1] of each next token under ``model`` at ``temperature``."""
    with attention_kernels(input_ids.device):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return (logprobs, logits) if return_logits else logprobs


def per_token_rows(episodes: list[Episode], pad_token_id: int, device, micro_batch_size: int,
                   fn: Callable[[Batch], torch.Tensor]) -> list[list[float]]:
    """``fn(batch) -> [B, T-1]`` over micro-batches of collated episodes, as one list per episode
    aligned with its ``input_ids`` (index 0, the first prompt token, gets 0)."""
    rows: list[list[float]] = []
    for start in range(0, len(episodes), micro_batch_size):
        eps = episodes[start:start + micro_batch_size]
        values = fn(collate(eps, pad_token_id, device)).detach().float().cpu()
        rows += [[0.0] + values[row, : len(e.input_ids) - 1].tolist() for row, e in enumerate(eps)]
    return rows


@dataclass
class PPOSettings:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batch_size: int = 32
    loss: str = "ppo_clip"
    dual_clip: float | None = None
    old_logprobs: str = "behaviour"
    tis_cap: float = 0.0
    vf_clip: float = 0.2
    norm_length: float | None = None
    """The constant of ``seq-mean-token-sum-norm`` (Dr.GRPO): the most sampled tokens an episode can
    have. None falls back to the longest response in each mini-batch (not a constant)."""

    def __post_init__(self) -> None:
        if self.loss not in ("ppo_clip", "gspo"):
            raise ValueError(f"unknown policy loss {self.loss!r}; choose ppo_clip or gspo")
        if self.old_logprobs not in ("behaviour", "recompute"):
            raise ValueError(f"old_logprobs must be behaviour or recompute, not {self.old_logprobs!r}")
        if self.tis_cap and self.old_logprobs != "recompute":
            raise ValueError("truncated importance sampling (tis_cap > 0) corrects recomputed old log-probs; "
                             "set old_logprobs='recompute'")


class Learner:
    """Owns the policy's optimiser (and an optional frozen reference) and runs PPO updates.

    With a ``critic`` (and its ``critic_optimizer``), ``update`` also takes the GAE ``returns`` and
    the critic's ``old_values`` per token and trains the critic on the clipped value loss in the
    same mini-batches, with its own optimiser and gradient clipping.
    """

    def __init__(self, model, optimizer: torch.optim.Optimizer, settings: PPOSettings, *, pad_token_id: int,
                 ref_model=None, seed: int = 0, critic=None, critic_optimizer=None) -> None:
        if (critic is None) != (critic_optimizer is None):
            raise ValueError("a critic needs its critic_optimizer (and the other way round)")
        self.critic = critic
        self.critic_optimizer = critic_optimizer
        self._targets: dict[int, tuple[list[float], list[float], list[int] | None]] = {}
        self.model = model
        self.optimizer = optimizer
        self.settings = settings
        self.pad_token_id = pad_token_id
        self.ref_model = ref_model
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_updates = 0
        self._recomputed: dict[int, list[float]] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update(self, episodes: list[Episode], advantages: list[float] | list[list[float]], *,
               returns: list[list[float]] | None = None, old_values: list[list[float]] | None = None,
               value_mask: list[list[int]] | None = None) -> dict[str, float]:
        """PPO epochs over ``episodes`` in mini-batches; returns metrics averaged over mini-batches."""
        s = self.settings
        if self.critic is not None:
            if returns is None or old_values is None:
                raise ValueError("a learner with a critic needs returns and old_values per token (GAE)")
            masks = value_mask if value_mask is not None else [None] * len(episodes)
            self._targets = {id(e): (r, v, vm) for e, r, v, vm in zip(episodes, returns, old_values, masks)}
        self.model.train()
        totals: dict[str, float] = {}
        count = 0
        before = self.recompute_old_logprobs(episodes) if s.old_logprobs == "recompute" else {}
        for _ in range(s.ppo_epochs):
            order = torch.randperm(len(episodes), generator=self.generator).tolist()
            chunk = math.ceil(len(order) / s.mini_batches)
            for start in range(0, len(order), chunk):
                idx = order[start:start + chunk]
                metrics = self.mini_batch_step([episodes[i] for i in idx], [advantages[i] for i in idx])
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1
        self._recomputed = {}
        self._targets = {}
        return {**before, **{k: v / max(count, 1) for k, v in totals.items()}}

    @torch.no_grad()
    def recompute_old_logprobs(self, episodes: list[Episode]) -> dict[str, float]:
        """Learner log-probs of the sampled tokens before any update; returns mismatch diagnostics.

        They become the PPO "old" policy. Against the behaviour log-probs they measure how far
        the sampler's numerics are from the learner's (bf16 kernels, a different engine): mean
        ``|delta|`` and the k3 estimate of KL(behaviour || learner) over sampled tokens.
        """
        s = self.settings
        sums = {"abs": 0.0, "kl": 0.0, "tokens": 0.0}

        def learner_logprobs(batch: Batch) -> torch.Tensor:
            lp = token_logprobs(self.model, batch.input_ids, batch.attention_mask, temperature=s.temperature)
            m = batch.loss_mask
            sums["abs"] += float(((lp - batch.old_logprobs) * m).abs().sum())
            sums["kl"] += float((kl_penalty(batch.old_logprobs, lp, "k3") * m).sum())
            sums["tokens"] += float(m.sum())
            return lp * m

        rows = per_token_rows(episodes, self.pad_token_id, self.device, s.micro_batch_size, learner_logprobs)
        self._recomputed = {id(e): row for e, row in zip(episodes, rows)}
        tokens = max(sums["tokens"], 1.0)
        return {"mismatch_abs_before_update": sums["abs"] / tokens, "mismatch_kl_before_update": sums["kl"] / tokens}

    def mini_batch_loss(self, episodes: list[Episode], advantages: list[float] | list[list[float]]
                        ) -> dict[str, float]:
        """Accumulate gradients of one mini-batch over micro-batches (no optimiser step)."""
        s = self.settings
        tokens = float(sum(sum(e.loss_mask[1:]) for e in episodes))
        live = float(sum(1 for e in episodes if any(e.loss_mask[1:])))
        denominator = tokens if s.agg == "token-mean" else live
        norm_length = s.norm_length or max((sum(e.loss_mask) for e in episodes), default=1)
        sums: dict[str, float] = {}
        for start in range(0, len(episodes), s.micro_batch_size):
            eps = episodes[start:start + s.micro_batch_size]
            batch = collate(eps, self.pad_token_id, self.device, advantages[start:start + s.micro_batch_size])
            weights = None
            if s.old_logprobs == "recompute":
                if any(id(e) not in self._recomputed for e in eps):
                    raise RuntimeError("old_logprobs='recompute': call update(), or recompute_old_logprobs() on "
                                       "these episodes before mini_batch_loss()")
                recomputed = torch.zeros_like(batch.old_logprobs)
                for row, e in enumerate(eps):
                    recomputed[row, : len(e.input_ids) - 1] = torch.tensor(self._recomputed[id(e)][1:])
                if s.tis_cap:
                    # Yao et al. 2025: weight by the (truncated) learner/behaviour ratio of the old policy
                    raw = torch.exp(recomputed - batch.old_logprobs) * batch.loss_mask
                    weights = raw.clamp(max=s.tis_cap)
                    sums["tis_weight"] = sums.get("tis_weight", 0.0) + float(weights.sum())
                    sums["tis_truncated"] = sums.get("tis_truncated", 0.0) + float(
                        ((raw > s.tis_cap).float() * batch.loss_mask).sum())
                batch.old_logprobs = recomputed
            logprobs, logits = token_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                              temperature=s.temperature, return_logits=True)
            if s.loss == "gspo":
                loss, m = gspo_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                    clip_low=s.clip_low, clip_high=s.clip_high, agg=s.agg,
                                    norm_length=norm_length, denominator=denominator, token_weights=weights)
            else:
                loss, m = policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                      clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip,
                                      agg=s.agg, norm_length=norm_length, denominator=denominator,
                                      token_weights=weights)
            picked = logits[batch.loss_mask.bool()]
            if s.entropy_coef > 0:
                entropy_tokens = torch.zeros_like(logprobs)
                entropy_tokens[batch.loss_mask.bool()] = entropy_from_logits(picked)
                loss = loss - s.entropy_coef * aggregate(entropy_tokens, batch.loss_mask, s.agg,
                                                         norm_length=norm_length, denominator=denominator)
            if s.kl_coef > 0 and self.ref_model is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.ref_model, batch.input_ids, batch.attention_mask,
                                         temperature=s.temperature)
                kl = kl_penalty(logprobs, ref, s.kl_kind)
                loss = loss + s.kl_coef * aggregate(kl, batch.loss_mask, s.agg, norm_length=norm_length,
                                                    denominator=denominator)
                sums["kl"] = sums.get("kl", 0.0) + float((kl.detach() * batch.loss_mask).sum())
            loss.backward()
            if self.critic is not None:
                self._critic_backward(eps, batch, self._value_count(episodes, tokens), sums)
            n_tok = float(batch.loss_mask.sum())
            with torch.no_grad():
                sums["loss"] = sums.get("loss", 0.0) + float(loss)
                sums["entropy"] = sums.get("entropy", 0.0) + float(entropy_from_logits(picked.detach()).sum())
                delta = (logprobs.detach() - batch.old_logprobs).abs() * batch.loss_mask
                sums["logprob_mismatch"] = sums.get("logprob_mismatch", 0.0) + float(delta.sum())
                for key in ("clip_frac_low", "clip_frac_high", "approx_kl"):
                    sums[key] = sums.get(key, 0.0) + m[key] * n_tok
        out = {"loss": sums["loss"]}
        if "vf_loss" in sums:
            out["vf_loss"] = sums["vf_loss"]
        for key in ("entropy", "logprob_mismatch", "clip_frac_low", "clip_frac_high", "approx_kl", "kl",
                    "tis_weight", "tis_truncated"):
            if key in sums:
                out[key] = sums[key] / max(tokens, 1.0)
        for key in ("vf_clip_frac", "vf_explained_var"):
            if key in sums:
                out[key] = sums[key] / max(sums["vf_count"], 1.0)
        return out

    def _value_count(self, episodes: list[Episode], tokens: float) -> float:
        """Positions the value loss averages over in a mini-batch: the value mask's, else the sampled tokens."""
        masks = [self._targets[id(e)][2] for e in episodes if id(e) in self._targets]
        if not masks or masks[0] is None:
            return tokens
        return float(sum(sum(vm[1:]) for vm in masks))

    def _critic_backward(self, episodes: list[Episode], batch: Batch, denominator: float, sums: dict) -> None:
        """Clipped value loss of one micro-batch (token-mean over the mini-batch's value positions), backward."""
        from ctxrl.algo.value import value_loss

        if any(id(e) not in self._targets for e in episodes):
            raise RuntimeError("critic targets missing: pass returns and old_values to update()")
        width = batch.loss_mask.shape[1]
        returns = torch.zeros_like(batch.loss_mask)
        old = torch.zeros_like(batch.loss_mask)
        mask = batch.loss_mask.clone()
        for row, e in enumerate(episodes):
            r, v, vm = self._targets[id(e)]
            n = len(e.input_ids) - 1
            returns[row, :n] = torch.tensor(r[1:], dtype=torch.float32)[:width]
            old[row, :n] = torch.tensor(v[1:], dtype=torch.float32)[:width]
            if vm is not None:
                mask[row] = 0.0
                mask[row, :n] = torch.tensor(vm[1:], dtype=torch.float32)[:width]
        values = self.critic(batch.input_ids, batch.attention_mask)
        loss, m = value_loss(values, old, returns, mask, clip=self.settings.vf_clip, denominator=denominator)
        loss.backward()
        n_tok = float(mask.sum())
        sums["vf_loss"] = sums.get("vf_loss", 0.0) + float(loss.detach())
        sums["vf_count"] = sums.get("vf_count", 0.0) + n_tok
        for key in ("vf_clip_frac", "vf_explained_var"):
            sums[key] = sums.get(key, 0.0) + m[key] * n_tok

    def mini_batch_step(self, episodes: list[Episode], advantages: list[float] | list[list[float]]
                        ) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        metrics = self.mini_batch_loss(episodes, advantages)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        # A mini-batch whose every advantage is 0 (and no KL, entropy or critic term) has no learning
        # signal: its gradient is 0, and an optimiser step would only replay Adam's momentum, a full
        # learning-rate-sized move per parameter for several steps after one informative batch.
        s = self.settings
        no_signal = (self.critic_optimizer is None and s.kl_coef == 0 and s.entropy_coef == 0
                     and not any(x != 0 for adv in advantages for x in (adv if isinstance(adv, list) else [adv])))
        metrics["no_signal"] = 0.0
        if not torch.isfinite(grad_norm) or not math.isfinite(metrics["loss"]):
            # Never let a non-finite step touch the weights or the optimiser state.
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            metrics["skipped"] = 1.0
        elif no_signal:
            self.optimizer.zero_grad(set_to_none=True)
            metrics["skipped"] = 0.0
            metrics["no_signal"] = 1.0
        else:
            self.optimizer.step()
            metrics["skipped"] = 0.0
        metrics["grad_norm"] = float(grad_norm)
        if self.critic_optimizer is not None:
            critic_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.settings.max_grad_norm)
            if torch.isfinite(critic_norm) and math.isfinite(metrics.get("vf_loss", 0.0)):
                self.critic_optimizer.step()
            else:
                self.critic_optimizer.zero_grad(set_to_none=True)
                metrics["critic_skipped"] = 1.0
            metrics["critic_grad_norm"] = float(critic_norm)
        return metrics
