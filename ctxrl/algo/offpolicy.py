"""Off-policy corrections: importance weights and rejection masks for tokens sampled by another policy.

The tokens a learner trains on were sampled by a *behaviour* policy ``mu``: an inference engine in bf16, an
older checkpoint (asynchronous rollouts with bounded staleness), or a truncated (top-k / top-p) sampler. The
learner's policy ``pi`` (its recomputed old log-probs, or the current ones) differs, by the per-token ratio
``rho_t = pi(y_t) / mu(y_t)``. Each function here turns the two log-probs into a correction and the figures a
run logs about it. Nothing is applied here: the caller multiplies each token's loss by ``weights`` and trains
on ``loss_mask``.

- ``token_tis``: ``w_t = min(rho_t, C)`` (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training");
- ``sequence_tis``: ``w = min(prod_t rho_t, C)`` on every token of the sequence (Seq-TIS; Li et al. 2025, "When
  speed kills stability");
- ``sequence_mis``: ``w = prod_t rho_t`` where it lies in ``[lower, upper]``, else the sequence leaves the loss
  (Seq-MIS; Li et al. 2025);
- ``geometric_mis``: the sequence leaves the loss where ``exp(mean_t log rho_t)`` is outside ``[lower, upper]``;
  optionally weighted by it (Geo-RS; Li et al. 2025);
- ``icepop``: ``w_t = rho_t`` where it lies in ``[lower, upper]``, else 0 (IcePop; Ling team 2025, "Every step
  evolves");
- ``m2po``: weight 0 on the tokens of largest ``(log rho_t)^2`` until the mean of the rest is <= ``threshold``
  (M2PO; Zheng et al. 2025, arXiv 2510.01161).

Conventions, shared by every function (the choices follow verl's rollout-correction helper,
``verl/trainer/ppo/rollout_corr_helper.py``, where it has the same correction; the tests compare them):

- inputs ``learner_logprobs``, ``behaviour_logprobs``, ``mask``: [B,T]; ``mask`` is the loss mask (1 on sampled
  tokens). Positions where it is 0 never enter a ratio, a weight or a figure (NaN there is harmless).
- ratios are exponentiated from log-ratios clamped to [-20, 20] (a sequence's log-ratio is clamped after the
  sum), so a weight is never inf;
- the result is an ``OffPolicyCorrection``: ``weights`` [B,T] (detached, 0 where ``mask`` is 0) to multiply each
  token's loss, ``loss_mask`` [B,T] the loss mask after rejection (a rejected sequence leaves the loss and its
  denominators: ``sequence_mis``, ``geometric_mis``), and ``metrics``. ``icepop`` and ``m2po`` zero the *weight*
  of a token but keep it in ``loss_mask``, so it still counts in a token-mean's denominator, as both papers
  average over all tokens (and verl's IcePop does);
- ``metrics`` (floats, or 0-d tensors with ``on_device=True``): ``ratio_mean`` (the raw ratio: per token, or per
  sequence for the sequence-level ones), ``weight_mean`` (the applied weight over the mask's tokens), and what was
  changed: ``clipped_frac`` (truncated), ``masked_frac`` (fraction of the mask's tokens whose weight or mask
  became 0), ``seq_masked_frac`` (fraction of sequences rejected), and M2PO's second moments.

``OFFPOLICY_CORRECTIONS`` names them, each with its settings dataclass (the keywords it takes beyond the common
ones, read from ``[algo.NAME]``: ``correction_settings``); ``algo.offpolicy`` chooses one. Every function takes the
same arguments (``advantages`` is read by ``m2po`` only). Not here: where the learner applies them (once per update,
over the whole batch, between its recomputed old log-probs and the behaviour ones: ``ctxrl.learner.objective``), and
the sampler/learner mismatch figures (``ctxrl.learner.learner``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ctxrl.registry import Registry
from ctxrl.settings import NON_NEGATIVE, POSITIVE, settings_table

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to +-this before ``exp`` (exp(20) is about 4.9e8), as verl's helper does."""


@dataclass(frozen=True)
class OffPolicyCorrection:
    """What a correction returns (see the module docstring)."""

    weights: torch.Tensor
    """[B,T] multiplies each token's loss; detached; 0 where the loss mask is 0."""
    loss_mask: torch.Tensor
    """[B,T] the loss mask after rejection: rejected tokens leave the loss and its denominators."""
    metrics: dict
    """The figures to log (floats, or 0-d tensors with ``on_device=True``)."""


Correction = Callable[..., OffPolicyCorrection]
OFFPOLICY_CORRECTIONS: Registry[Correction] = Registry("off-policy correction",
                                                       entry_point_group="ctxrl.offpolicy_corrections")
"""The corrections by name; each takes ``(learner_logprobs, behaviour_logprobs, mask, *, advantages=None,
on_device=False, **its own settings)``."""
OFFPOLICY_CORRECTIONS.add_builtins(__name__)  # (this module's are ctxrl's own: the configuration reference lists them)


def _register(name: str, settings: type) -> Callable[[Correction], Correction]:
    def add(fn: Correction) -> Correction:
        fn.Settings = settings  # (its keywords beyond the common ones: the [algo.NAME] table)
        return OFFPOLICY_CORRECTIONS.register(name, fn)
    return add


@dataclass(frozen=True)
class CapSettings:
    """``[algo.token_tis]`` / ``[algo.sequence_tis]``."""

    cap: float = field(default=2.0, metadata=POSITIVE)
    """The largest importance weight (C)."""


@dataclass(frozen=True)
class BandSettings:
    """``[algo.sequence_mis]`` / ``[algo.icepop]``: the band of ratios kept (``lower = 0``: none below)."""

    lower: float = 0.5
    """Smallest ratio kept."""
    upper: float = 2.0
    """Largest ratio kept."""

    def __post_init__(self) -> None:
        _bounds(self.lower, self.upper)


@dataclass(frozen=True)
class IcePopSettings(BandSettings):
    """``[algo.icepop]``: the band of token ratios kept."""

    upper: float = 5.0
    """Largest ratio kept."""


@dataclass(frozen=True)
class GeometricMISSettings(BandSettings):
    """``[algo.geometric_mis]``: the band of the sequences' geometric-mean ratio kept, and whether it also weights."""

    lower: float = 0.999
    """Smallest geometric-mean ratio kept."""
    upper: float = 1.001
    """Largest geometric-mean ratio kept."""
    reweight: bool = False
    """Also weight a kept sequence's tokens by its geometric-mean ratio."""


@dataclass(frozen=True)
class M2POSettings:
    """``[algo.m2po]``."""

    threshold: float = field(default=0.04, metadata=NON_NEGATIVE)
    """The largest mean second moment ``(log rho)^2`` of the tokens kept (the paper's tau_M2)."""


def correction_settings(name: str) -> type:
    """The settings dataclass of the correction registered as ``name``."""
    return get_offpolicy_correction(name).Settings


def correction_keywords(name: str, options=None) -> dict:
    """The keywords the correction ``name`` takes from its settings (``options``; None: their defaults)."""
    options = options if options is not None else correction_settings(name)()
    return settings_table(options)


def _log_ratio(learner_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``log pi - log mu`` with 0 where the mask is 0, the mask as the log-ratio's dtype)."""
    if not learner_logprobs.shape == behaviour_logprobs.shape == mask.shape:
        raise ValueError(f"learner_logprobs {tuple(learner_logprobs.shape)}, behaviour_logprobs "
                         f"{tuple(behaviour_logprobs.shape)} and mask {tuple(mask.shape)} must be equal [B, T] shapes")
    live = mask.bool()
    log_ratio = torch.where(live, learner_logprobs.detach() - behaviour_logprobs.detach(), 0.0)
    return log_ratio, live.to(log_ratio.dtype)


def _mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp(min=1.0)


def _out(metrics: dict, on_device: bool) -> dict:
    return metrics if on_device else {k: float(v) for k, v in metrics.items()}


def _bounds(lower: float, upper: float) -> tuple[float, float]:
    """Log bounds of ``[lower, upper]`` (``lower = 0``: none below)."""
    if not 0.0 <= lower <= upper or upper <= 0.0:
        raise ValueError(f"need 0 <= lower <= upper and upper > 0, got lower={lower}, upper={upper}")
    return (math.log(lower) if lower > 0 else -math.inf), math.log(upper)


def _sequence_log_ratio(log_ratio: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sequence sum of log-ratios [B], 1 for sequences with a sampled token [B])."""
    return (log_ratio * m).sum(-1), (m.sum(-1) > 0).to(m.dtype)


def _reject_sequences(mask: torch.Tensor, m: torch.Tensor, live: torch.Tensor, *, tested: torch.Tensor,
                      bounds: tuple[float, float], weight: torch.Tensor, ratio: torch.Tensor,
                      on_device: bool) -> OffPolicyCorrection:
    """A sequence-level rejection: a sequence whose ``tested`` log-ratio lies outside the log ``bounds`` leaves the
    loss mask; a kept sequence's tokens are weighted by its ``weight``. Figures: ``ratio_mean`` (of ``ratio``, over
    sequences), ``weight_mean``, ``masked_frac`` (tokens) and ``seq_masked_frac`` (sequences).

    mask, m (the mask as the log-ratio's dtype): [B,T]; live (1 for a sequence with a sampled token), tested,
    weight, ratio: [B]  ->  OffPolicyCorrection
    """
    low, high = bounds
    keep = ((tested >= low) & (tested <= high)).to(m.dtype) * live
    loss_mask = mask * keep.unsqueeze(-1).to(mask.dtype)
    weights = (weight * keep).unsqueeze(-1) * m
    metrics = {"ratio_mean": _mean(ratio, live), "weight_mean": _mean(weights, m),
               "masked_frac": _mean(1.0 - keep.unsqueeze(-1).expand_as(m), m),
               "seq_masked_frac": _mean(1.0 - keep, live)}
    return OffPolicyCorrection(weights, loss_mask, _out(metrics, on_device))


@_register("token_tis", CapSettings)
@torch.no_grad()
def token_tis(learner_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
              cap: float = 2.0, advantages: torch.Tensor | None = None,
              on_device: bool = False) -> OffPolicyCorrection:
    """Token-level truncated importance sampling (TIS; Yao et al. 2025): ``w_t = min(rho_t, cap)``.

    Biased (the truncation) but of bounded variance; no token leaves the loss. ``clipped_frac``: the fraction
    of sampled tokens with ``rho_t > cap``. verl: ``rollout_is="token"`` with a float threshold.

    learner_logprobs, behaviour_logprobs, mask: [B,T]  ->  OffPolicyCorrection
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_ratio, m = _log_ratio(learner_logprobs, behaviour_logprobs, mask)
    raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
    weights = raw.clamp(max=cap)
    metrics = {"ratio_mean": _mean(raw, m), "weight_mean": _mean(weights, m),
               "clipped_frac": _mean((raw > cap).to(m.dtype), m)}
    return OffPolicyCorrection(weights, mask, _out(metrics, on_device))


@_register("sequence_tis", CapSettings)
@torch.no_grad()
def sequence_tis(learner_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
                 cap: float = 2.0, advantages: torch.Tensor | None = None,
                 on_device: bool = False) -> OffPolicyCorrection:
    """Sequence-level truncated IS (Seq-TIS; Li et al. 2025): ``w = min(prod_t rho_t, cap)`` on every token.

    The product is the importance weight of the whole sequence, unbiased before truncation for a sequence-level
    objective; its variance grows with length, hence the cap. ``ratio_mean``: mean sequence ratio over sequences;
    ``weight_mean``: mean weight over tokens (verl's ``rollout_is_mean``); ``clipped_frac``: fraction of sequences
    truncated. verl: ``rollout_is="sequence"`` with a float threshold.

    learner_logprobs, behaviour_logprobs, mask: [B,T]  ->  OffPolicyCorrection
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_ratio, m = _log_ratio(learner_logprobs, behaviour_logprobs, mask)
    seq_log_ratio, live = _sequence_log_ratio(log_ratio, m)
    raw = torch.exp(seq_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    weights = raw.clamp(max=cap).unsqueeze(-1) * m
    metrics = {"ratio_mean": _mean(raw, live), "weight_mean": _mean(weights, m),
               "clipped_frac": _mean((seq_log_ratio > math.log(cap)).to(m.dtype), live)}
    return OffPolicyCorrection(weights, mask, _out(metrics, on_device))


@_register("sequence_mis", BandSettings)
@torch.no_grad()
def sequence_mis(learner_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
                 lower: float = 0.5, upper: float = 2.0, advantages: torch.Tensor | None = None,
                 on_device: bool = False) -> OffPolicyCorrection:
    """Sequence-level masked IS (Seq-MIS; Li et al. 2025): ``w = prod_t rho_t`` where it lies in ``[lower, upper]``;
    a sequence outside is rejected (it leaves ``loss_mask``).

    Rejection instead of truncation: a sequence that the learner finds far more (or less) likely than the
    sampler did is treated as garbage, not as a capped signal. ``lower = 0`` rejects only above (the paper's
    ``rho * 1[rho <= C]``). The bounds are tested on the unclamped log-ratio sum. verl's preset
    ``decoupled_seq_is_rs(is_threshold=upper, rs_threshold="lower_upper")`` (``rollout_is="sequence"`` with
    ``rollout_rs="seq_sum_k1"``, 0.5 and 2 by default) gives the same weights and mask, except that verl clamps
    each token's log-ratio to +-20 before summing for the rejection test, and states its k1 bounds on
    ``mu / pi``: ``"a_b"`` there is ``[1/b, 1/a]`` here.

    learner_logprobs, behaviour_logprobs, mask: [B,T]  ->  OffPolicyCorrection
    """
    bounds = _bounds(lower, upper)
    log_ratio, m = _log_ratio(learner_logprobs, behaviour_logprobs, mask)
    seq_log_ratio, live = _sequence_log_ratio(log_ratio, m)
    raw = torch.exp(seq_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return _reject_sequences(mask, m, live, tested=seq_log_ratio, bounds=bounds, weight=raw, ratio=raw,
                             on_device=on_device)


@_register("geometric_mis", GeometricMISSettings)
@torch.no_grad()
def geometric_mis(learner_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
                  lower: float = 0.999, upper: float = 1.001, reweight: bool = False,
                  advantages: torch.Tensor | None = None, on_device: bool = False) -> OffPolicyCorrection:
    """Geometric-mean rejection (Geo-RS; Li et al. 2025): reject a sequence whose geometric-mean ratio
    ``g = exp(mean_t log rho_t)`` lies outside ``[lower, upper]``.

    The per-token mean makes the test independent of length (a product of ratios drifts with length; its
    geometric mean does not), so the bounds can be tight (verl's preset: +-0.1%). ``reweight=True`` also weights
    each kept sequence's tokens by ``g`` (geometric-mean IS, GMPO's ratio applied as a correction); the default
    weights kept tokens by 1, as verl's Geo-RS (``rollout_rs="seq_mean_k1"``, no IS weights). verl states the
    k1 bounds on ``mu / pi``: its ``"a_b"`` is ``[1/b, 1/a]`` here.

    learner_logprobs, behaviour_logprobs, mask: [B,T]  ->  OffPolicyCorrection
    """
    bounds = _bounds(lower, upper)
    log_ratio, m = _log_ratio(learner_logprobs, behaviour_logprobs, mask)
    seq_log_ratio, live = _sequence_log_ratio(log_ratio, m)
    geo_log_ratio = seq_log_ratio / m.sum(-1).clamp(min=1.0)
    geo = torch.exp(geo_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return _reject_sequences(mask, m, live, tested=geo_log_ratio, bounds=bounds,
                             weight=geo if reweight else torch.ones_like(geo), ratio=geo, on_device=on_device)


@_register("icepop", IcePopSettings)
@torch.no_grad()
def icepop(learner_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
           lower: float = 0.5, upper: float = 5.0, advantages: torch.Tensor | None = None,
           on_device: bool = False) -> OffPolicyCorrection:
    """IcePop's two-sided token mask (Ling team 2025, Ring-1T): ``w_t = rho_t`` where ``lower <= rho_t <= upper``,
    else 0.

    Tokens whose ratio left the band carry no gradient at all (instead of a truncated one): the discrepancy
    between engines compounds there. They stay in ``loss_mask`` (the objective averages over all tokens).
    Defaults are the paper's ``alpha = 0.5``, ``beta = 5``. ``masked_frac``: fraction of sampled tokens outside
    the band (verl's ``rollout_is_oob_ratio``). verl: ``rollout_is="token"`` with threshold ``"lower_upper"``.

    learner_logprobs, behaviour_logprobs, mask: [B,T]  ->  OffPolicyCorrection
    """
    _bounds(lower, upper)
    log_ratio, m = _log_ratio(learner_logprobs, behaviour_logprobs, mask)
    raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
    inside = ((raw >= lower) & (raw <= upper)).to(m.dtype)
    weights = raw * inside
    metrics = {"ratio_mean": _mean(raw, m), "weight_mean": _mean(weights, m), "masked_frac": _mean(1.0 - inside, m)}
    return OffPolicyCorrection(weights, mask, _out(metrics, on_device))


@_register("m2po", M2POSettings)
@torch.no_grad()
def m2po(learner_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
         threshold: float = 0.04, advantages: torch.Tensor | None = None,
         on_device: bool = False) -> OffPolicyCorrection:
    """M2PO's second-moment mask (Zheng et al. 2025, "Prosperity before collapse", arXiv 2510.01161, Algorithm 1).

    ``M2_t = (log rho_t)^2``; while the mean ``M2`` of the candidate tokens still in the trust region exceeds
    ``threshold`` (the paper's ``tau_M2 = 0.04`` throughout), the candidate with the largest ``M2_t`` is masked.
    Greedy removal of the largest keeps the ``m`` smallest, ``m`` the largest count whose mean is within the
    threshold; it is computed that way, with one sort (ties broken by position).

    Candidates: with ``advantages`` [B,T], only the tokens PPO's clip could bind, ``A > 0`` with ``rho > 1`` or
    ``A < 0`` with ``rho < 1`` (the paper's "only constrain trust-region tokens"); without, every sampled token.
    The mask is over the whole batch given (the paper's batch-level constraint). Masked tokens get weight 0 and
    stay in ``loss_mask`` (the paper averages over all tokens). Figures: ``m2`` and ``m2_after``, the mean ``M2``
    of the candidates before and after, and ``masked_frac`` over all sampled tokens. verl has no M2PO; the
    authors' release replaces the mask by a clip at the same budget; this is the paper's algorithm.

    learner_logprobs, behaviour_logprobs, mask (, advantages): [B,T]  ->  OffPolicyCorrection
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    log_ratio, m = _log_ratio(learner_logprobs, behaviour_logprobs, mask)
    second = log_ratio.square()
    candidate = m.bool()
    if advantages is not None:
        if advantages.shape != mask.shape:
            raise ValueError(f"advantages {tuple(advantages.shape)} and mask {tuple(mask.shape)} must be equal")
        candidate &= ((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0))
    values = second[candidate]
    order = torch.sort(values, stable=True).indices
    prefix_mean = values[order].cumsum(0) / torch.arange(1, len(values) + 1, dtype=values.dtype)
    kept = int((prefix_mean <= threshold).sum())  # prefix means never decrease: the ones within form a prefix
    drop = torch.zeros_like(values, dtype=torch.bool)
    drop[order[kept:]] = True
    dropped = torch.zeros_like(candidate)
    dropped[candidate] = drop
    weights = m * (~dropped).to(m.dtype)
    zero = values.new_zeros(())
    metrics = {"ratio_mean": _mean(torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)), m),
               "weight_mean": _mean(weights, m), "masked_frac": _mean(dropped.to(m.dtype), m),
               "m2": values.mean() if len(values) else zero,
               "m2_after": prefix_mean[kept - 1] if kept else zero}
    return OffPolicyCorrection(weights, mask, _out(metrics, on_device))


def offpolicy_correction_names() -> list[str]:
    """Every registered correction."""
    return OFFPOLICY_CORRECTIONS.names()


def get_offpolicy_correction(name: str) -> Correction:
    """The correction registered as ``name``; an unknown name is an error listing the known ones."""
    return OFFPOLICY_CORRECTIONS.get(name)
