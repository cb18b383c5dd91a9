"""The learner: PPO updates on collated training rows (``ctxrl.learner.batch``).

It takes a ``Batch`` of tensors, never episode objects: the estimator has already turned episodes
into rows with per-token advantages (and critic targets), and ``collate`` into padded tensors.

Gradient accumulation is exact: each mini-batch's loss is normalised by the mini-batch's total
count (mask-1 tokens for ``token-mean``, live sequences for the ``seq-mean-*`` modes), not by each
micro-batch's, so splitting a mini-batch into micro-batches of uneven lengths changes neither the
loss nor the gradient. Micro-batches are ``micro_batch_size`` rows, or packed by a token budget
(``max_tokens_per_microbatch``, ``ctxrl.learner.batch.pack``).

Memory: log-probs and entropy come from ``ctxrl.learner.logprobs`` in chunks of positions, only at
the sampled tokens, so full-vocabulary logits never exist for a whole micro-batch. The model
computes in its storage dtype; the optimiser may update float32 masters of its weights, with
loss scaling for float16 (``ctxrl.learner.precision``): clipping is over the tensors the optimiser
steps on (``trainable_grads``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ctxrl.algo.distill import topk_forward_kl
from ctxrl.algo.losses import LOSSES, OLD_LOGPROBS, aggregate, gspo_loss, kl_penalty, policy_loss
from ctxrl.learner.batch import Batch, collate, micro_batches, per_token_rows
from ctxrl.learner.flat import MODES as FLAT_MODES
from ctxrl.learner.flat import training_decoder
from ctxrl.learner.logprobs import flat_token_logprobs, token_logprobs
from ctxrl.learner.packing import pack
from ctxrl.learner.policy import Reference
from ctxrl.learner.precision import MasterAdamW, Precision, trainable_grads
from ctxrl.models.kernels import attention_kernels
from ctxrl.sections import AlgoConfig, TrainConfig

__all__ = ["Learner", "LearnerSettings", "micro_batches", "per_token_rows", "token_logprobs"]


@dataclass(frozen=True)
class LearnerSettings:
    """What a learner is told: the run's ``[algo]`` and ``[train]`` sections as they are (not copied field by field:
    STYLE 15), and the few values derived from the rest of the run, computed once where the run is assembled
    (``ctxrl.run.build.learner_settings``). The learner reads ``micro_batch_tokens``, never
    ``train.max_tokens_per_microbatch``: the budget is the user's, or the one the memory plan chose."""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    temperature: float = 1.0
    """The sampler's temperature (1 for greedy sampling): log-probs are of ``logits / temperature``."""
    norm_length: float | None = None
    """The constant of ``seq-mean-token-sum-norm`` (Dr.GRPO): the most sampled tokens an episode can
    have. None falls back to the longest response in each mini-batch (not a constant)."""
    micro_batch_tokens: int = 0
    """Token budget of a micro-batch (0: ``train.micro_batch_size`` rows at a time)."""
    distill_top_k_coef: float = 0.0
    """Weight of the forward KL from a distillation teacher's top-K to the policy (``algo.distill.top_k``), on
    batches that carry the teacher's top-K (``Batch.teacher_ids``)."""
    vf_clip: float = 0.2
    """The critic's value clip (``[algo.gae].vf_clip``: a critic's settings are GAE's)."""

    def __post_init__(self) -> None:
        a = self.algo
        if a.loss not in LOSSES:
            raise ValueError(f"unknown policy loss {a.loss!r}; choose one of {', '.join(LOSSES)}")
        if a.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {', '.join(OLD_LOGPROBS)}, not {a.old_logprobs!r}")
        if self.train.flat_forward not in FLAT_MODES:
            raise ValueError(f"flat_forward must be one of {', '.join(FLAT_MODES)}, not {self.train.flat_forward!r}")
        if a.tis_cap and a.old_logprobs != "recompute":
            raise ValueError("truncated importance sampling (tis_cap > 0) corrects recomputed old log-probs; "
                             "set old_logprobs='recompute'")

    @property
    def kl_coef(self) -> float:
        """The KL-to-reference coefficient of the loss (0 when ``algo.kl_placement`` puts the KL in the reward)."""
        return self.algo.kl_coef if self.algo.kl_placement == "loss" else 0.0

    def logprobs(self, model, micro: Batch, *, with_entropy: bool = False, extra_ids: torch.Tensor | None = None):
        """The learner's log-probs (and entropy: with a gradient only when the loss has an entropy bonus) of
        ``micro``'s sampled tokens under ``model``; with ``pack_sequences`` the forward pass runs on packed rows
        and the results come back in ``micro``'s padded layout; with a flat decoder (``flat_forward``) they run laid
        end to end. ``extra_ids`` [B, T-1, K]: also the log-probs of those tokens (last in the tuple), on the flat
        or the padded pass (not packed rows)."""
        t, entropy_grad = self.train, self.algo.entropy_coef > 0
        decoder = training_decoder(model, t.flat_forward)
        # (a micro-batch is cut to its longest row: its width; past a sliding window, HF's pass)
        if decoder is not None and decoder.fits(micro.input_ids.shape[1]):
            return flat_token_logprobs(decoder, micro.input_ids, micro.lengths, mask=micro.loss_mask,
                                       temperature=self.temperature, chunk=t.logprob_chunk_tokens,
                                       with_entropy=with_entropy, entropy_grad=entropy_grad, extra_ids=extra_ids)
        if not t.pack_sequences or extra_ids is not None:
            return token_logprobs(model, micro.input_ids, micro.attention_mask, temperature=self.temperature,
                                  mask=micro.loss_mask, chunk=t.logprob_chunk_tokens, with_entropy=with_entropy,
                                  entropy_grad=entropy_grad, extra_ids=extra_ids)
        dtype = next(model.parameters()).dtype
        packed = pack(micro.input_ids, micro.lengths, pad_id=0,
                      dtype=dtype if dtype.is_floating_point else torch.float32)
        out = token_logprobs(model, packed.input_ids, packed.attention_mask, temperature=self.temperature,
                             mask=packed.to_packed(micro.loss_mask), chunk=t.logprob_chunk_tokens,
                             with_entropy=with_entropy, entropy_grad=entropy_grad,
                             position_ids=packed.position_ids)
        if with_entropy:
            return packed.unpack(out[0]), packed.unpack(out[1])
        return packed.unpack(out)


class Learner:
    """Owns the policy's optimiser (and an optional KL reference) and runs PPO updates.

    ``parallel``: data-parallel ranks (``ctxrl.distributed.data_parallel``); every rank is given the same
    batch and computes the same update. ``reference``: a ``Reference`` (``ctxrl.learner.policy``) or a frozen
    module. ``precision``:
    loss scaling (default: plain float32); the optimiser may be a ``MasterAdamW``. With a ``critic`` (and its
    ``critic_optimizer``) the batch must carry the GAE ``returns`` and the critic's ``old_values``
    per token; the critic is trained on the clipped value loss in the same mini-batches, with its
    own optimiser and gradient clipping.
    """

    def __init__(self, model, optimizer: torch.optim.Optimizer, settings: LearnerSettings, *, pad_token_id: int,
                 reference=None, precision: Precision | None = None, seed: int = 0, critic=None,
                 critic_optimizer=None, parallel=None) -> None:
        if (critic is None) != (critic_optimizer is None):
            raise ValueError("a critic needs its critic_optimizer (and the other way round)")
        self.critic = critic
        self.critic_optimizer = critic_optimizer
        self.model = model
        self.optimizer = optimizer
        self.settings = settings
        self.pad_token_id = pad_token_id
        self.reference = reference if reference is None or isinstance(reference, Reference) else Reference(reference)
        self.precision = precision or Precision()
        self.generator = torch.Generator().manual_seed(seed)
        self.micro_batches_run = 0
        """Micro-batches the last ``update`` ran (every epoch's)."""
        self.flat_rows = False
        """Whether the last micro-batches ran through the flat forward pass (``ctxrl.learner.flat``)."""
        self.skipped_updates = 0
        self.parallel = parallel
        """A ``ctxrl.distributed.data_parallel.DataParallel``: this rank trains on its share of each mini-batch's
        rows, the loss normalised by the whole mini-batch's counts, gradients and figures summed across ranks."""
        # decided now, on every rank alike (an error here)
        decoder = training_decoder(model, settings.train.flat_forward)
        if decoder is not None and decoder.graphs is not None:  # one capture for every micro-batch of the run
            decoder.graphs.min_tokens = settings.micro_batch_tokens
            # float32 masters whose hooks take every layer's gradient as it is accumulated: a replay's buffer needs no
            # copy of its own
            layer_params = [p for layer in decoder.layers for p in layer.parameters()]
            decoder.graphs.copy_grads = not (isinstance(optimizer, MasterAdamW) and optimizer.consumes(layer_params))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def collate(self, rows) -> Batch:
        """``collate(rows)`` with this learner's pad id, on the CPU (micro-batches move to the device)."""
        return collate(rows, self.pad_token_id)

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over ``batch`` in mini-batches; returns metrics averaged over mini-batches."""
        t = self.settings.train
        if self.critic is not None and (batch.returns is None or batch.old_values is None):
            raise ValueError("a learner with a critic needs returns and old_values per token (GAE)")
        self.model.train()
        totals: dict[str, float] = {}
        count = 0
        before = {}
        if self.settings.algo.old_logprobs == "recompute":
            batch, before = self.recompute_old_logprobs(batch)
        self.micro_batches_run = 0
        for _ in range(t.ppo_epochs):
            order = torch.randperm(len(batch), generator=self.generator).tolist()
            chunk = math.ceil(len(order) / t.mini_batches)
            for start in range(0, len(order), chunk):
                metrics = self.mini_batch_step(batch.select(order[start:start + chunk]))
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1
        # which pass trained and in how many micro-batches an epoch: the sizes a user tunes, seen in the step's row
        # (this rank's own under data parallelism: LAYOUT_KEYS describe how it ran, not what it computed)
        layout = dict(zip(LAYOUT_KEYS, (self.micro_batches_run / max(t.ppo_epochs, 1), float(self.flat_rows))))
        return {**before, **{k: v / max(count, 1) for k, v in totals.items()}, **layout}

    @torch.no_grad()
    def recompute_old_logprobs(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The batch with the learner's log-probs of the sampled tokens before any update, and mismatch diagnostics.

        They become the PPO "old" policy. Against the behaviour log-probs they measure how far
        the sampler's numerics are from the learner's (bf16 kernels, a different engine): mean
        ``|delta|`` and the k3 estimate of KL(behaviour || learner) over sampled tokens.
        """
        s = self.settings
        sums = {"abs": 0.0, "kl": 0.0, "tokens": 0.0}

        def learner_logprobs(micro: Batch) -> torch.Tensor:
            lp = s.logprobs(self.model, micro)
            m = micro.loss_mask
            sums["abs"] += float(((lp - micro.old_logprobs) * m).abs().sum())
            sums["kl"] += float((kl_penalty(micro.old_logprobs, lp, "k3") * m).sum())
            sums["tokens"] += float(m.sum())
            return lp * m

        mine, share = self._share(batch)
        size = self.rows_per_micro_batch(share)  # (which also says whether the rows run flat: no padding to count)
        rows = per_token_rows(share, self.device, size, learner_logprobs, s.micro_batch_tokens,
                              padded=not self.flat_rows) if mine else []
        recomputed = torch.zeros_like(batch.old_logprobs)
        for row, values in zip(mine, rows):
            recomputed[row, : len(values) - 1] = torch.tensor(values[1:])
        if self.parallel is not None:  # each rank filled its own rows: the sum is the whole batch's
            recomputed = self.parallel.sum_(recomputed.to(self.device)).to(recomputed.device)
            sums = self.parallel.sum_figures(sums, self.device)
        tokens = max(sums["tokens"], 1.0)
        return (Batch(**{**batch.__dict__, "recomputed": recomputed}),
                {"mismatch_abs_before_update": sums["abs"] / tokens, "mismatch_kl_before_update": sums["kl"] / tokens})

    def mini_batch_loss(self, batch: Batch) -> dict[str, float]:
        """Accumulate gradients of one mini-batch over micro-batches (no optimiser step)."""
        s = self.settings
        tokens = float(batch.loss_mask.sum())
        live = float((batch.loss_mask.sum(1) > 0).sum())
        denominator = tokens if s.algo.agg == "token-mean" else live
        norm_length = s.norm_length or (float(batch.loss_mask.sum(1).max()) if len(batch) else 1)
        value_count = tokens if batch.value_mask is None else float(batch.value_mask.sum())
        if s.algo.old_logprobs == "recompute" and batch.recomputed is None:
            raise RuntimeError("old_logprobs='recompute': call update(), or recompute_old_logprobs() on this batch "
                               "before mini_batch_loss()")
        sums: dict[str, float] = {}
        mine, share = self._share(batch)  # (the denominators above are the whole mini-batch's, on every rank)
        # backward too: activation checkpointing recomputes attention there, and a different kernel would
        # not reproduce what the forward pass saved
        with attention_kernels(self.device):
            if mine:
                size = self.rows_per_micro_batch(share)  # (which also says whether the rows run flat)
                for _, micro in micro_batches(share, size, self.device, s.micro_batch_tokens,
                                              padded=not self.flat_rows):
                    self._micro_batch(micro, s, sums, denominator=denominator, norm_length=norm_length,
                                      value_count=value_count)
                    self.micro_batches_run += 1
        if self.parallel is not None:  # the same figures on every rank, even one whose share was empty
            sums = self.parallel.sum_figures({k: sums.get(k, 0.0) for k in figure_keys(
                self.settings, kl=self.reference is not None, critic=self.critic is not None)}, self.device)
            if self.precision.scaler is not None:  # (a rank that scaled no loss yet must still unscale with the rest)
                self.precision.scaler.scale(torch.zeros((), device=self.device))
        return mini_batch_metrics(sums, tokens)

    def rows_per_micro_batch(self, batch: Batch) -> int:
        """``micro_batch_size``, or every row where only the token budget should bound a micro-batch: the flat
        forward pass (no padding: its memory follows the tokens) with a budget, over rows it takes."""
        s = self.settings
        decoder = training_decoder(self.model, s.train.flat_forward) if len(batch) else None
        self.flat_rows = decoder is not None and decoder.fits(int(batch.lengths.max()))
        rows = s.train.micro_batch_size
        if s.micro_batch_tokens <= 0:
            return rows
        return max(len(batch), rows) if self.flat_rows else rows

    def _share(self, batch: Batch) -> tuple[list[int], Batch]:
        """The rows of ``batch`` this learner trains on (all of them, or this rank's share), and those rows."""
        if self.parallel is None:
            return list(range(len(batch))), batch
        mine = self.parallel.shard(batch.lengths.tolist())
        return mine, batch.select(mine)

    def _micro_batch(self, micro: Batch, s: LearnerSettings, sums: dict[str, float], *, denominator: float,
                     norm_length: float, value_count: float) -> None:
        """Forward and backward of one micro-batch; its figures are added to ``sums``."""
        a = s.algo
        weights = None
        old = micro.old_logprobs
        if a.old_logprobs == "recompute":
            if a.tis_cap:
                # Yao et al. 2025: weight by the (truncated) learner/behaviour ratio of the old policy
                raw = torch.exp(micro.recomputed - micro.old_logprobs) * micro.loss_mask
                weights = raw.clamp(max=a.tis_cap)
                sums["tis_weight"] = sums.get("tis_weight", 0.0) + weights.detach().sum()
                sums["tis_truncated"] = sums.get("tis_truncated", 0.0) + (
                    (raw > a.tis_cap).float() * micro.loss_mask).sum()
            old = micro.recomputed
        topk = s.distill_top_k_coef > 0 and micro.teacher_ids is not None
        if topk:
            logprobs, entropy, student_topk = s.logprobs(self.model, micro, with_entropy=True,
                                                         extra_ids=micro.teacher_ids)
        else:
            logprobs, entropy = s.logprobs(self.model, micro, with_entropy=True)
        if a.loss == "gspo":
            loss, m = gspo_loss(logprobs, old, micro.advantages, micro.loss_mask,
                                clip_low=a.clip_low, clip_high=a.clip_high, agg=a.agg,
                                norm_length=norm_length, denominator=denominator, token_weights=weights,
                                on_device=True)
        else:
            loss, m = policy_loss(logprobs, old, micro.advantages, micro.loss_mask,
                                  clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip or None,
                                  agg=a.agg, norm_length=norm_length, denominator=denominator,
                                  token_weights=weights, on_device=True)
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * aggregate(entropy, micro.loss_mask, a.agg,
                                                     norm_length=norm_length, denominator=denominator)
        if s.kl_coef > 0 and self.reference is not None:
            ref = self.reference.logprobs(micro.input_ids, micro.attention_mask, temperature=s.temperature,
                                          mask=micro.loss_mask, chunk=s.train.logprob_chunk_tokens)
            kl = kl_penalty(logprobs, ref, a.kl_kind)
            loss = loss + s.kl_coef * aggregate(kl, micro.loss_mask, a.agg, norm_length=norm_length,
                                                denominator=denominator)
            sums["kl"] = sums.get("kl", 0.0) + (kl.detach() * micro.loss_mask).sum()
        if topk:
            forward_kl = topk_forward_kl(micro.teacher_probs, student_topk, micro.loss_mask)
            loss = loss + s.distill_top_k_coef * aggregate(forward_kl, micro.loss_mask, a.agg,
                                                           norm_length=norm_length, denominator=denominator)
            sums["distill_topk_kl"] = sums.get("distill_topk_kl", 0.0) + forward_kl.detach().sum()
        if loss.requires_grad:  # (a micro-batch without one sampled token has nothing to learn from)
            self.precision.backward(loss)
        if self.critic is not None:
            self._critic_backward(micro, value_count, sums)
        # Figures stay on the device (0-d tensors) until the mini-batch ends: one host sync, not eight per micro-batch.
        with torch.no_grad():
            n_tok = micro.loss_mask.sum()
            sums["loss"] = sums.get("loss", 0.0) + loss.detach()
            sums["entropy"] = sums.get("entropy", 0.0) + (entropy.detach() * micro.loss_mask).sum()
            delta = (logprobs.detach() - old).abs() * micro.loss_mask
            sums["logprob_mismatch"] = sums.get("logprob_mismatch", 0.0) + delta.sum()
            for key in ("clip_frac_low", "clip_frac_high", "approx_kl"):
                sums[key] = sums.get(key, 0.0) + m[key] * n_tok

    def _critic_backward(self, micro: Batch, denominator: float, sums: dict) -> None:
        """Clipped value loss of one micro-batch (token-mean over the mini-batch's value positions), backward."""
        from ctxrl.algo.value import value_loss

        mask = micro.loss_mask if micro.value_mask is None else micro.value_mask
        values = self.critic(micro.input_ids, micro.attention_mask)
        loss, m = value_loss(values, micro.old_values, micro.returns, mask, clip=self.settings.vf_clip,
                             denominator=denominator)
        self.precision.backward(loss)
        n_tok = float(mask.sum())
        sums["vf_loss"] = sums.get("vf_loss", 0.0) + float(loss.detach())
        sums["vf_count"] = sums.get("vf_count", 0.0) + n_tok
        for key in ("vf_clip_frac", "vf_explained_var"):
            sums[key] = sums.get(key, 0.0) + m[key] * n_tok

    def mini_batch_step(self, batch: Batch) -> dict[str, float]:
        """One optimiser step on the mini-batch ``batch`` (skipped when non-finite or without signal)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        metrics = self.mini_batch_loss(batch)
        if self.parallel is not None:  # each rank's gradient is its share of the whole mini-batch's: sum them
            self.parallel.sum_gradients(trainable_grads(self.optimizer))
            if self.critic_optimizer is not None:
                self.parallel.sum_gradients(trainable_grads(self.critic_optimizer))
        precision = self.precision
        precision.unscale(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable_grads(self.optimizer), self.settings.train.max_grad_norm)
        # A mini-batch whose every advantage is 0 (and no KL, entropy, distillation top-K or critic term) has no
        # learning signal: its gradient is 0, and an optimiser step would only replay Adam's momentum, a full
        # learning-rate-sized move per parameter for several steps after one informative batch.
        s = self.settings
        dense = s.distill_top_k_coef > 0 and batch.teacher_ids is not None
        no_signal = (self.critic_optimizer is None and s.kl_coef == 0 and s.algo.entropy_coef == 0 and not dense
                     and not bool((batch.advantages != 0).any()))
        metrics["no_signal"] = 0.0
        overflow = (precision.scaler is not None and not torch.isfinite(grad_norm) and math.isfinite(metrics["loss"])
                    and precision.loss_scale >= 1.0)
        if overflow:
            # Loss scaling looking for its scale: the scaled gradients overflowed float16. The step is
            # skipped and the scale halves (update below); not a failure (the loss is finite, the scale sane).
            self.optimizer.zero_grad(set_to_none=True)
            metrics["skipped"] = 0.0
            metrics["overflow"] = 1.0
        elif not torch.isfinite(grad_norm) or not math.isfinite(metrics["loss"]):
            # Never let a non-finite step touch the weights or the optimiser state.
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            metrics["skipped"] = 1.0
        elif no_signal:
            self.optimizer.zero_grad(set_to_none=True)
            metrics["skipped"] = 0.0
            metrics["no_signal"] = 1.0
        else:
            precision.step(self.optimizer)
            metrics["skipped"] = 0.0
        metrics["grad_norm"] = float(grad_norm)
        if self.critic_optimizer is not None:
            precision.unscale(self.critic_optimizer)
            critic_norm = torch.nn.utils.clip_grad_norm_(trainable_grads(self.critic_optimizer),
                                                         self.settings.train.max_grad_norm)
            if torch.isfinite(critic_norm) and math.isfinite(metrics.get("vf_loss", 0.0)):
                precision.step(self.critic_optimizer)
            else:
                self.critic_optimizer.zero_grad(set_to_none=True)
                metrics["critic_skipped"] = 1.0
            metrics["critic_grad_norm"] = float(critic_norm)
        if precision.scaler is not None:
            precision.update()
            metrics["loss_scale"] = precision.loss_scale
        return metrics


def figure_keys(s: LearnerSettings, *, kl: bool, critic: bool) -> list[str]:
    """The sums a mini-batch accumulates under settings ``s`` (``Learner._micro_batch``, ``_critic_backward``);
    ``kl``: the learner has a reference, ``critic``: a critic."""
    keys = ["loss", "entropy", "logprob_mismatch", "clip_frac_low", "clip_frac_high", "approx_kl"]
    if s.algo.old_logprobs == "recompute" and s.algo.tis_cap:
        keys += ["tis_weight", "tis_truncated"]
    if s.kl_coef > 0 and kl:
        keys.append("kl")
    if s.distill_top_k_coef > 0:
        keys.append("distill_topk_kl")
    if critic:
        keys += ["vf_loss", "vf_count", "vf_clip_frac", "vf_explained_var"]
    return keys


LAYOUT_KEYS = ("learner_micro_batches", "learner_flat_forward")
"""Figures of an update that say how this process ran it (micro-batches an epoch, the flat pass or not), not what
it computed: under data parallelism each rank reports its own share's."""


def mini_batch_metrics(sums: dict[str, float], tokens: float) -> dict[str, float]:
    """A mini-batch's figures from its sums (one host transfer): per sampled token, the critic's per value position."""
    on_device = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    if on_device:  # one transfer for all of them
        values = torch.stack([sums[k].detach().double().reshape(()) for k in on_device]).tolist()
        sums = {**sums, **dict(zip(on_device, values))}
    out = {"loss": sums["loss"]}
    if "vf_loss" in sums:
        out["vf_loss"] = sums["vf_loss"]
    for key in ("entropy", "logprob_mismatch", "clip_frac_low", "clip_frac_high", "approx_kl", "kl",
                "tis_weight", "tis_truncated", "distill_topk_kl"):
        if key in sums:
            out[key] = sums[key] / max(tokens, 1.0)
    for key in ("vf_clip_frac", "vf_explained_var"):
        if key in sums:
            out[key] = sums[key] / max(sums["vf_count"], 1.0)
    return out
