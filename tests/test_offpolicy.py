"""Off-policy corrections (ctxrl.algo.offpolicy): against verl's rollout-correction helper on random float64
inputs, against hand-derived values, and M2PO against a literal transcription of the paper's Algorithm 1.

The ``verl_*`` functions below are test-only references: formulas transcribed from reading
``verl/trainer/ppo/rollout_corr_helper.py`` of verl-project/verl at commit
1dda039b9c6311889a9c9a26040677e1254814f9 (functions ``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask``, ``compute_is_metrics``), not verl's code. verl's ``masked_mean`` divides by
``count + 1e-8``; the references keep that, so the figures agree to about 1e-9 rather than exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from ctxrl.algo.offpolicy import (
    OFFPOLICY_CORRECTIONS,
    geometric_mis,
    get_offpolicy_correction,
    icepop,
    m2po,
    offpolicy_correction_names,
    sequence_mis,
    sequence_tis,
    token_tis,
)

# -- verl, transcribed (test-only) ---------------------------------------------------------------


def verl_masked_mean(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis) / (mask.sum(axis) + 1e-8)


def verl_is_weights(log_ratio, mask, level, threshold):
    """compute_rollout_correction_weights: (weights, figures). ``threshold``: a float (TIS) or (lower, upper)
    (IcePop)."""
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-20, 20))
        seq_log = None
    else:
        seq_log = (torch.where(mask.bool(), log_ratio, 0.0) * mask).sum(-1, keepdim=True)
        raw = torch.exp(seq_log.clamp(-20, 20)).expand_as(log_ratio)
    raw = raw * mask
    if isinstance(threshold, tuple):
        lower, upper = threshold
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    else:
        lower, upper = 1.0 / threshold, threshold
        weights = raw.clamp(max=upper)
    figures = {"rollout_is_mean": verl_masked_mean(weights, mask)}
    if level == "token":
        figures["rollout_is_ratio_fraction_high"] = verl_masked_mean((raw > upper).double(), mask)
    else:  # log space, over rows
        figures["rollout_is_ratio_fraction_high"] = (seq_log > math.log(upper)).double().mean()
    if isinstance(threshold, tuple):
        figures["rollout_is_oob_ratio"] = verl_masked_mean(((raw < lower) | (raw > upper)).double(), mask)
    return weights, figures


def verl_rejection_mask(log_ratio, mask, option, lower, upper):
    """compute_rollout_rejection_mask for one k1 option (``seq_sum_k1`` or ``seq_mean_k1``) with threshold
    ``"lower_upper"``: (modified response mask, figures). k1 = -log(pi / mu) per token; bounds on its log."""
    k1 = -log_ratio.clamp(-20, 20)
    if option == "seq_sum_k1":
        stat = (torch.where(mask.bool(), k1, 0.0) * mask).sum(-1)
    else:
        stat = verl_masked_mean(k1, mask, axis=-1)
    keep = ((stat >= math.log(lower)) & (stat <= math.log(upper))).unsqueeze(-1).expand_as(mask)
    final = keep.double()
    figures = {"rollout_rs_masked_fraction": verl_masked_mean(1 - final, mask),
               "rollout_rs_seq_masked_fraction": ((~(final > 0.5) & mask.bool()).any(-1)).double().mean()}
    return mask * final, figures


# -- random float64 inputs -----------------------------------------------------------------------


def random_batch(seed, b=8, t=11, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    learner = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    behaviour = learner + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    mask = (torch.rand(b, t, generator=g, dtype=torch.float64) < 0.7).double()
    mask[:, 0] = 1.0  # every row samples something (verl's row figures count every row)
    return learner, behaviour, mask


def close(a, b, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(4))
def test_token_tis_matches_verl(seed):
    learner, behaviour, mask = random_batch(seed)
    out = token_tis(learner, behaviour, mask, cap=1.2)
    weights, figures = verl_is_weights(learner - behaviour, mask, "token", 1.2)
    close(out.weights, weights, 1e-12)
    assert torch.equal(out.loss_mask, mask)
    close(out.metrics["weight_mean"], figures["rollout_is_mean"])
    close(out.metrics["clipped_frac"], figures["rollout_is_ratio_fraction_high"])
    assert 0 < out.metrics["clipped_frac"] < 1


@pytest.mark.parametrize("seed", range(4))
def test_sequence_tis_matches_verl(seed):
    learner, behaviour, mask = random_batch(seed)
    out = sequence_tis(learner, behaviour, mask, cap=1.5)
    weights, figures = verl_is_weights(learner - behaviour, mask, "sequence", 1.5)
    close(out.weights, weights, 1e-12)
    close(out.metrics["weight_mean"], figures["rollout_is_mean"])
    close(out.metrics["clipped_frac"], figures["rollout_is_ratio_fraction_high"])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bounds", [(0.5, 2.0), (0.3, 1.5)])
def test_sequence_mis_matches_verl_seq_is_rs(seed, bounds):
    lower, upper = bounds
    learner, behaviour, mask = random_batch(seed, spread=0.5)
    out = sequence_mis(learner, behaviour, mask, lower=lower, upper=upper)
    # verl's preset decoupled_seq_is_rs: Seq-TIS at the upper bound + seq_sum_k1 rejection, bounds on mu/pi
    rs_mask, rs_figures = verl_rejection_mask(learner - behaviour, mask, "seq_sum_k1", 1 / upper, 1 / lower)
    is_weights, _ = verl_is_weights(learner - behaviour, mask, "sequence", upper)
    assert torch.equal(out.loss_mask, rs_mask)
    close(out.weights, is_weights * rs_mask, 1e-12)
    close(out.metrics["masked_frac"], rs_figures["rollout_rs_masked_fraction"])
    close(out.metrics["seq_masked_frac"], rs_figures["rollout_rs_seq_masked_fraction"])
    assert 0 < out.metrics["seq_masked_frac"] < 1  # the inputs reject some sequences and keep others


@pytest.mark.parametrize("seed", range(4))
def test_geometric_mis_matches_verl_geo_rs(seed):
    learner, behaviour, mask = random_batch(seed)
    out = geometric_mis(learner, behaviour, mask, lower=0.95, upper=1.08)
    rs_mask, rs_figures = verl_rejection_mask(learner - behaviour, mask, "seq_mean_k1", 1 / 1.08, 1 / 0.95)
    assert torch.equal(out.loss_mask, rs_mask)
    close(out.weights, rs_mask, 0)  # Geo-RS weights kept tokens by 1
    close(out.metrics["masked_frac"], rs_figures["rollout_rs_masked_fraction"])
    close(out.metrics["seq_masked_frac"], rs_figures["rollout_rs_seq_masked_fraction"])
    assert 0 < out.metrics["seq_masked_frac"] < 1


@pytest.mark.parametrize("seed", range(4))
def test_icepop_matches_verl(seed):
    learner, behaviour, mask = random_batch(seed)
    out = icepop(learner, behaviour, mask, lower=0.8, upper=1.25)
    weights, figures = verl_is_weights(learner - behaviour, mask, "token", (0.8, 1.25))
    close(out.weights, weights, 1e-12)
    assert torch.equal(out.loss_mask, mask)  # as verl: IcePop changes weights, not the mask
    close(out.metrics["masked_frac"], figures["rollout_is_oob_ratio"])
    close(out.metrics["weight_mean"], figures["rollout_is_mean"])
    assert 0 < out.metrics["masked_frac"] < 1


# -- M2PO: no verl function; the paper's Algorithm 1, literally ----------------------------------


def m2po_algorithm_1(log_ratio, mask, threshold, advantages=None):
    """Zheng et al. 2025, Algorithm 1: T <- trust-region tokens; while mean_{T} M2 > tau: drop argmax_T M2."""
    region = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    if advantages is not None:
        region = [(i, t) for i, t in region
                  if (advantages[i, t] > 0 and log_ratio[i, t] > 0) or (advantages[i, t] < 0 and log_ratio[i, t] < 0)]
    keep = torch.ones_like(mask)
    while region and sum(float(log_ratio[p]) ** 2 for p in region) / len(region) > threshold:
        j = max(region, key=lambda p: float(log_ratio[p]) ** 2)
        keep[j] = 0.0
        region.remove(j)
    return keep * mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_advantages", [False, True])
def test_m2po_is_algorithm_1(seed, with_advantages):
    learner, behaviour, mask = random_batch(seed, spread=0.4)
    advantages = None
    if with_advantages:
        advantages = torch.randn(8, generator=torch.Generator().manual_seed(seed + 9)).unsqueeze(1).expand(8, 11)
    out = m2po(learner, behaviour, mask, threshold=0.04, advantages=advantages)
    expected = m2po_algorithm_1(learner - behaviour, mask, 0.04, advantages)
    assert torch.equal(out.weights, expected)
    assert torch.equal(out.loss_mask, mask)  # the paper averages over all tokens
    assert 0 < out.metrics["masked_frac"] < 1
    assert out.metrics["m2"] > 0.04 >= out.metrics["m2_after"]


# -- hand-derived values -------------------------------------------------------------------------


def by_ratios(rows):
    """(learner, behaviour, mask) with per-token ratios ``rows`` (None: a masked position holding NaN)."""
    width = max(len(r) for r in rows)
    learner = torch.full((len(rows), width), float("nan"), dtype=torch.float64)
    behaviour = torch.zeros(len(rows), width, dtype=torch.float64) - 1.0
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, row in enumerate(rows):
        for t, ratio in enumerate(row):
            if ratio is not None:
                learner[i, t], mask[i, t] = math.log(ratio) - 1.0, 1.0
    return learner, behaviour, mask


def test_token_tis_by_hand():
    out = token_tis(*by_ratios([[0.5, 3.0, 1.0, None]]), cap=2.0)
    # weights min(rho, 2): 0.5, 2, 1, (masked) 0; one of three truncated; raw mean (0.5 + 3 + 1) / 3
    close(out.weights, [[0.5, 2.0, 1.0, 0.0]], 1e-12)
    assert out.metrics == pytest.approx({"ratio_mean": 1.5, "weight_mean": 3.5 / 3, "clipped_frac": 1 / 3})


def test_sequence_tis_by_hand():
    out = sequence_tis(*by_ratios([[2.0, 3.0], [0.5, None]]), cap=2.0)
    # products 6 (truncated to 2) and 0.5; the NaN sits on a masked position and changes nothing
    close(out.weights, [[2.0, 2.0], [0.5, 0.0]], 1e-12)
    assert out.metrics == pytest.approx({"ratio_mean": 3.25, "weight_mean": 4.5 / 3, "clipped_frac": 0.5})


def test_sequence_mis_by_hand():
    out = sequence_mis(*by_ratios([[2.0, 3.0], [0.6, 1.0], [0.5, 0.5]]), lower=0.3, upper=2.0)
    # products 6 (> 2: rejected), 0.6 (kept, weight 0.6), 0.25 (< 0.3: rejected)
    close(out.loss_mask, [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]], 0)
    close(out.weights, [[0.0, 0.0], [0.6, 0.6], [0.0, 0.0]], 1e-12)
    assert out.metrics["seq_masked_frac"] == pytest.approx(2 / 3)
    assert out.metrics["masked_frac"] == pytest.approx(4 / 6)
    # lower = 0: only the upper side rejects
    assert sequence_mis(*by_ratios([[0.5, 0.5]]), lower=0.0, upper=2.0).loss_mask.tolist() == [[1.0, 1.0]]


def test_geometric_mis_by_hand():
    rows = by_ratios([[4.0, 1.0], [1.1, 0.9, None]])
    # geometric means: sqrt(4 * 1) = 2 (rejected), sqrt(1.1 * 0.9) = sqrt(0.99) = 0.994987 (kept)
    out = geometric_mis(*rows, lower=0.9, upper=1.1)
    close(out.loss_mask, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]], 0)
    close(out.weights, out.loss_mask, 0)
    assert out.metrics["ratio_mean"] == pytest.approx((2 + math.sqrt(0.99)) / 2)
    weighted = geometric_mis(*rows, lower=0.9, upper=1.1, reweight=True)
    close(weighted.weights, [[0.0, 0.0, 0.0], [math.sqrt(0.99), math.sqrt(0.99), 0.0]], 1e-12)


def test_icepop_by_hand():
    out = icepop(*by_ratios([[0.4, 1.0, 6.0, 5.0]]), lower=0.5, upper=5.0)
    # outside [0.5, 5]: 0.4 and 6 -> 0; inside keep their ratio (5 is on the bound, kept)
    close(out.weights, [[0.0, 1.0, 0.0, 5.0]], 1e-12)
    assert out.metrics["masked_frac"] == 0.5 and out.metrics["weight_mean"] == pytest.approx(1.5)


def test_m2po_by_hand():
    rows = by_ratios([[math.exp(0.1), math.exp(-0.3), math.exp(0.5), math.exp(0.2)]])
    # M2 = 0.01, 0.09, 0.25, 0.04; sorted prefix means 0.01, 0.025, 0.0467, 0.0975: two within 0.04, so the
    # two largest (0.25 and 0.09) are masked; mean before 0.0975, after 0.025
    out = m2po(*rows, threshold=0.04)
    close(out.weights, [[1.0, 0.0, 0.0, 1.0]], 0)
    assert out.metrics["m2"] == pytest.approx(0.0975) and out.metrics["m2_after"] == pytest.approx(0.025)
    assert out.metrics["masked_frac"] == 0.5
    # advantages +, +, +, -: only A > 0 with rho > 1 (tokens 0, 2) or A < 0 with rho < 1 (none) are candidates;
    # their M2 0.01, 0.25 average 0.13 > 0.04, so 0.25 goes; 0.01 stays
    out = m2po(*rows, threshold=0.04, advantages=torch.tensor([[1.0, 1.0, 1.0, -1.0]], dtype=torch.float64))
    close(out.weights, [[1.0, 1.0, 0.0, 1.0]], 0)
    assert out.metrics["m2"] == pytest.approx(0.13) and out.metrics["m2_after"] == pytest.approx(0.01)


# -- the registry and the conventions ------------------------------------------------------------

NAMES = ["token_tis", "sequence_tis", "sequence_mis", "geometric_mis", "icepop", "m2po"]


def test_registry_names_each_correction():
    assert offpolicy_correction_names() == NAMES
    assert get_offpolicy_correction("icepop") is icepop and "m2po" in OFFPOLICY_CORRECTIONS
    with pytest.raises(ValueError, match="unknown off-policy correction 'tis'"):
        get_offpolicy_correction("tis")


@pytest.mark.parametrize("name", NAMES)
def test_every_correction_takes_the_same_arguments_and_ignores_masked_positions(name):
    fn = get_offpolicy_correction(name)
    learner, behaviour, mask = random_batch(1)
    advantages = torch.randn(8, 11, dtype=torch.float64)
    out = fn(learner, behaviour, mask, advantages=advantages)
    noisy = learner.clone()
    noisy[mask == 0] = float("nan")
    again = fn(noisy, behaviour, mask, advantages=advantages)
    close(again.weights, out.weights, 0)
    assert again.metrics == out.metrics
    assert bool((out.weights[mask == 0] == 0).all()) and bool((out.loss_mask <= mask).all())
    assert not out.weights.requires_grad
    on_device = fn(learner, behaviour, mask, advantages=advantages, on_device=True).metrics
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in on_device.values())
    # nothing sampled: no NaN anywhere
    empty = fn(learner, behaviour, torch.zeros_like(mask), advantages=advantages)
    assert float(empty.weights.abs().sum()) == 0 and not any(math.isnan(v) for v in empty.metrics.values())


def test_bad_settings_are_errors():
    learner, behaviour, mask = random_batch(0)
    with pytest.raises(ValueError, match="lower <= upper"):
        sequence_mis(learner, behaviour, mask, lower=2.0, upper=0.5)
    with pytest.raises(ValueError, match="cap must be > 0"):
        token_tis(learner, behaviour, mask, cap=0.0)
    with pytest.raises(ValueError, match="equal"):
        icepop(learner, behaviour[:, :3], mask)
