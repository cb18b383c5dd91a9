"""Policy losses by name (ctxrl.algo.policy_losses): each against verl on random float64 inputs (value, gradient
and the figures both report), and against a hand-derived value.

The ``verl_*`` functions below are test-only references: formulas transcribed from reading
``verl/trainer/ppo/core_algos.py`` of verl-project/verl at commit 1dda039b9c6311889a9c9a26040677e1254814f9
(``agg_loss``, ``compute_policy_loss_vanilla``, ``_gspo``, ``_cispo``, ``_sapo``, ``_geo_mean``, ``_clip_cov``,
``_kl_cov``, ``_dppo_tv``, ``_dppo_kl``), not verl's code. verl's ``masked_mean`` and its seq-mean-token-mean
divide by ``count + 1e-8``; the references keep that, so values agree to about 1e-9 relative, not bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from ctxrl.algo.losses import gspo_loss, policy_loss
from ctxrl.algo.policy_losses import POLICY_LOSSES, get_policy_loss, policy_loss_names
from ctxrl.algo.policy_losses.cispo import cispo_loss
from ctxrl.algo.policy_losses.cov import clip_cov_loss, kl_cov_loss
from ctxrl.algo.policy_losses.dppo import dppo_kl_loss, dppo_tv_loss
from ctxrl.algo.policy_losses.gmpo import gmpo_loss
from ctxrl.algo.policy_losses.sapo import sapo_loss

# -- verl, transcribed (test-only) ---------------------------------------------------------------


def masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis)


def masked_mean(values, mask, axis=None):
    return masked_sum(values, mask, axis) / (mask.sum(axis) + 1e-8)


def verl_agg(loss_mat, mask, mode, scale=None):
    """agg_loss with one data-parallel rank and no global batch info."""
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / mask.sum()
    live = (mask.sum(-1) > 0).double()
    if mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(-1) / (mask.sum(-1) + 1e-8)
        return masked_sum(per_seq, live) / live.sum()
    loss = masked_sum((loss_mat * mask).sum(-1), live) / live.sum()
    return loss / scale if mode == "seq-mean-token-sum-norm" else loss


def verl_vanilla(old, lp, adv, mask, mode, low, high, c):
    log_ratio = torch.clamp(lp - old, -20, 20)
    ratio = torch.exp(log_ratio)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * c
    pg = torch.where(adv < 0, torch.minimum(pg3, clip1), clip1)
    return verl_agg(pg, mask, mode), {"pg_clipfrac": masked_mean((pg2 > pg1).double(), mask)}


def verl_gspo(old, lp, adv, mask, low, high):
    seq = masked_sum(lp - old, mask, -1) / mask.sum(-1).clamp(min=1)
    log_s = torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    pg1, pg2 = -adv * s, -adv * torch.clamp(s, 1 - low, 1 + high)
    return verl_agg(torch.maximum(pg1, pg2), mask, "seq-mean-token-mean"), {
        "pg_clipfrac": masked_mean((pg2 > pg1).double(), mask)}


def verl_cispo(old, lp, adv, mask, mode, low, high):
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    pg = -clipped.detach() * adv * lp
    return verl_agg(pg, mask, mode), {"pg_clipfrac": masked_mean((ratio != clipped).double(), mask)}


def verl_sapo(old, lp, adv, mask, tau_pos, tau_neg):
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    taus = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return verl_agg(-gates * adv, mask, "seq-mean-token-mean"), {}


def verl_geo_mean(old, lp, adv, mask, low, high, weights=None):
    d = lp - old
    sgn = torch.sign(adv)
    d_clamp = torch.clamp(d, -low, high)
    d_min = sgn * torch.min(sgn * d, sgn * d_clamp)
    n = mask.sum(-1)
    ratio = torch.exp((d_min * mask).sum(-1) / (n + 1e-8))
    seq_adv = (adv * mask).sum(-1) / (n + 1e-8)
    pg = -seq_adv * ratio
    if weights is not None:
        pg = pg * torch.exp((torch.log(weights + 1e-10) * mask).sum(-1) / (n + 1e-8))
    clipped = (d != d_clamp).double()
    return pg.mean(), {"pg_clipfrac": masked_mean(clipped * (adv > 0), mask),
                       "pg_clipfrac_lower": masked_mean(clipped * (adv < 0), mask)}


def verl_clip_cov(old, lp, adv, mask, mode, low, high, ratio_k, lb, ub):
    ratio = torch.exp(lp - old)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    by_origin = (pg2 > pg1) & (mask > 0)
    cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp.detach(), mask))
    cov = cov.detach().clone()
    cov[mask == 0] = -torch.inf
    cov[by_origin] = -torch.inf
    clip_num = max(int(ratio_k * mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    corr = torch.ones_like(adv)
    if len(idx) > 0:
        idx = idx[torch.randperm(len(idx))[: min(clip_num, len(idx))]]
        corr[idx[:, 0], idx[:, 1]] = 0
    pg = torch.maximum(pg1, pg2) * corr
    return verl_agg(pg, mask, mode), {"pg_clipfrac": masked_mean((corr == 0).double(), mask)}


def verl_kl_cov(old, lp, adv, mask, mode, ratio_k, coef):
    d = lp - old
    ratio = torch.exp(d)
    pg = -adv * ratio
    pg_kl = -adv * ratio + coef * d.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, logp = adv[valid].detach().reshape(-1), lp[valid].detach().reshape(-1)
    cov = (a - a.mean()) * (logp - logp.mean())
    top = valid_idx[torch.topk(cov, max(1, int(len(cov) * ratio_k)), largest=True).indices]
    rows, cols = top // adv.shape[1], top % adv.shape[1]
    pg = pg.clone()
    pg[rows, cols] = pg_kl[rows, cols]
    return verl_agg(pg, mask, mode), {"ppo_kl": masked_mean(d.abs(), mask)}


def verl_dppo(old, lp, adv, mask, mode, low, high, c, kind):
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    truncated = torch.clamp(ratio, max=c).detach()
    p, p_old = torch.exp(lp), torch.exp(old)
    if kind == "tv":
        pos, neg = (p - p_old) <= high, (p - p_old) >= -low
    else:
        bkl = p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        pos, neg = (bkl <= high) | (p <= p_old), (bkl <= low) | (p >= p_old)
    valid = torch.where(adv > 0, pos, neg).detach().double()
    pg = -adv * truncated * lp * valid
    return verl_agg(pg, mask, mode), {"pg_clipfrac": masked_mean(1.0 - valid, mask),
                                      "pg_clipfrac_lower": masked_mean((ratio > c).double() * valid, mask)}


# -- random float64 inputs -----------------------------------------------------------------------


def random_inputs(seed, b=6, t=10, spread=0.4, per_sequence_advantage=False):
    """Valid log-probabilities (both < 0), advantages, a mask with a sampled token in every row."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, generator=g, dtype=torch.float64) * 2
    old = torch.nn.functional.logsigmoid(logits)
    lp = torch.nn.functional.logsigmoid(logits + torch.randn(b, t, generator=g, dtype=torch.float64) * spread)
    adv = torch.randn(b, 1 if per_sequence_advantage else t, generator=g, dtype=torch.float64).expand(b, t)
    mask = (torch.rand(b, t, generator=g, dtype=torch.float64) < 0.75).double()
    mask[:, 0] = 1.0
    return old, lp, adv.contiguous(), mask


def compare(ours, reference, lp, tol=1e-9):
    """Same loss value and same gradient with respect to the log-probs."""
    (ours_loss, ours_metrics), (ref_loss, ref_metrics) = ours, reference
    torch.testing.assert_close(ours_loss, ref_loss, rtol=tol, atol=tol)
    (ours_grad,) = torch.autograd.grad(ours_loss, lp, retain_graph=True)
    (ref_grad,) = torch.autograd.grad(ref_loss, lp, retain_graph=True)
    torch.testing.assert_close(ours_grad, ref_grad, rtol=tol, atol=tol)
    return ours_metrics, {k: float(v.detach()) for k, v in ref_metrics.items()}


SEEDS = range(3)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_matches_verl_vanilla(seed, agg, dual_clip):
    old, lp, adv, mask = random_inputs(seed, spread=0.6)
    lp.requires_grad_(True)
    ours = get_policy_loss("ppo_clip")(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip,
                                       agg=agg)
    reference = verl_vanilla(old, lp, adv, mask, agg, 0.2, 0.28, 1e12 if dual_clip is None else dual_clip)
    ours_m, ref_m = compare(ours, reference, lp)
    assert ours_m["clip_frac_low"] + ours_m["clip_frac_high"] == pytest.approx(ref_m["pg_clipfrac"], rel=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_matches_verl(seed):
    old, lp, adv, mask = random_inputs(seed, spread=0.05, per_sequence_advantage=True)
    lp.requires_grad_(True)
    ours = get_policy_loss("gspo")(lp, old, adv, mask, clip_low=0.01, clip_high=0.012)
    ours_m, ref_m = compare(ours, verl_gspo(old, lp, adv, mask, 0.01, 0.012), lp)
    assert ours_m["clip_frac_low"] + ours_m["clip_frac_high"] == pytest.approx(ref_m["pg_clipfrac"], rel=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_cispo_matches_verl(seed, agg):
    old, lp, adv, mask = random_inputs(seed)
    lp.requires_grad_(True)
    ours = cispo_loss(lp, old, adv, mask, clip_low=0.3, clip_high=0.2, agg=agg)
    ours_m, ref_m = compare(ours, verl_cispo(old, lp, adv, mask, agg, 0.3, 0.2), lp)
    assert ours_m["clip_frac_low"] + ours_m["clip_frac_high"] == pytest.approx(ref_m["pg_clipfrac"], rel=1e-7)
    assert ours_m["clip_frac_low"] > 0 and ours_m["clip_frac_high"] > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_matches_verl(seed):
    old, lp, adv, mask = random_inputs(seed)
    lp.requires_grad_(True)
    compare(sapo_loss(lp, old, adv, mask, tau_pos=1.0, tau_neg=1.05), verl_sapo(old, lp, adv, mask, 1.0, 1.05), lp)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("with_weights", [False, True])
def test_gmpo_matches_verl_geo_mean(seed, with_weights):
    old, lp, adv, mask = random_inputs(seed, per_sequence_advantage=True)
    lp.requires_grad_(True)
    weights = torch.rand(6, 10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    weights = weights if with_weights else None
    ours = gmpo_loss(lp, old, adv, mask, clip_low=0.4, clip_high=0.3, token_weights=weights)
    ours_m, ref_m = compare(ours, verl_geo_mean(old, lp, adv, mask, 0.4, 0.3, weights), lp, tol=1e-7)
    assert ours_m["clip_frac_high"] == pytest.approx(ref_m["pg_clipfrac"], rel=1e-7)
    assert ours_m["clip_frac_low"] == pytest.approx(ref_m["pg_clipfrac_lower"], rel=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_matches_verl(seed):
    old, lp, adv, mask = random_inputs(seed, spread=0.6)
    adv = adv * 2
    lp.requires_grad_(True)
    torch.manual_seed(100 + seed)  # the same random choice: both draw one permutation from the global generator
    ours = clip_cov_loss(lp, old, adv, mask, clip_cov_ratio=0.1, clip_cov_lb=0.5, clip_cov_ub=5.0)
    torch.manual_seed(100 + seed)
    reference = verl_clip_cov(old, lp, adv, mask, "token-mean", 0.2, 0.2, 0.1, 0.5, 5.0)
    ours_m, ref_m = compare(ours, reference, lp)
    assert ours_m["cov_clip_frac"] == pytest.approx(ref_m["pg_clipfrac"], rel=1e-7) and ours_m["cov_clip_frac"] > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_cov_matches_verl(seed):
    old, lp, adv, mask = random_inputs(seed)
    lp.requires_grad_(True)
    ours = kl_cov_loss(lp, old, adv, mask, kl_cov_ratio=0.1, ppo_kl_coef=0.7)
    ours_m, ref_m = compare(ours, verl_kl_cov(old, lp, adv, mask, "token-mean", 0.1, 0.7), lp)
    assert ours_m["abs_kl"] == pytest.approx(ref_m["ppo_kl"], rel=1e-7)
    assert ours_m["kl_cov_frac"] == pytest.approx(int(mask.sum() * 0.1) / float(mask.sum()))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_matches_verl(seed, kind):
    old, lp, adv, mask = random_inputs(seed, spread=0.8)
    lp.requires_grad_(True)
    fn, bound = (dppo_tv_loss, 0.1) if kind == "tv" else (dppo_kl_loss, 0.03)
    ours = fn(lp, old, adv, mask, clip_low=bound, clip_high=bound * 1.5, truncation=1.3)
    reference = verl_dppo(old, lp, adv, mask, "token-mean", bound, bound * 1.5, 1.3, kind)
    ours_m, ref_m = compare(ours, reference, lp)
    assert ours_m["clip_frac_low"] + ours_m["clip_frac_high"] == pytest.approx(ref_m["pg_clipfrac"], rel=1e-7)
    assert ours_m["truncated_frac"] == pytest.approx(ref_m["pg_clipfrac_lower"], rel=1e-7)
    assert ours_m["clip_frac_high"] > 0 and ours_m["truncated_frac"] > 0


# -- hand-derived values -------------------------------------------------------------------------


def logs(*probabilities):
    return torch.tensor([list(probabilities)], dtype=torch.float64).log()


def test_cispo_by_hand():
    old, lp = logs(0.5, 0.5), logs(0.8, 0.2).requires_grad_(True)
    adv, mask = torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    loss, m = cispo_loss(lp, old, adv, mask, clip_low=0.5, clip_high=0.2)
    # ratios 1.6 and 0.4, weights clip(., 0.5, 1.2) = 1.2 and 0.5 (no gradient through them)
    # per token -w A log p: -1.2 * 1 * log 0.8 = 0.267772; -0.5 * -1 * log 0.2 = -0.804719; token mean -0.268474
    assert loss.item() == pytest.approx((-1.2 * math.log(0.8) + 0.5 * math.log(0.2)) / 2)
    assert loss.item() == pytest.approx(-0.268474, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.6, 0.25]], dtype=torch.float64))  # -w A / 2
    assert m["clip_frac_high"] == 0.5 and m["clip_frac_low"] == 0.5


def test_sapo_by_hand():
    # on-policy with A = 1, tau 1: gate sigmoid(0) * 4 = 2, loss -2; the gradient is the plain policy gradient
    # (slope 4 s (1 - s) r = 1)
    old = logs(0.5)
    lp = logs(0.5).requires_grad_(True)
    loss, m = sapo_loss(lp, old, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    assert float(lp.grad) == pytest.approx(-1.0) and m["soft_clip_weight"] == pytest.approx(1.0)
    # r = 2, A = -1, tau_neg = 1.05: loss = +sigmoid(1.05) * 4 / 1.05 = 0.740775 * 3.809524 = 2.822000
    lp = logs(1.0).requires_grad_(True)
    loss, m = sapo_loss(lp, old, -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
    s = 1 / (1 + math.exp(-1.05))
    assert loss.item() == pytest.approx(s * 4 / 1.05) and loss.item() == pytest.approx(2.822000, abs=1e-6)
    loss.backward()
    # d/dlog p of s(1.05 (r - 1)) * 4/1.05 = 4 s (1 - s) r: the gradient weight decays to 4 s (1 - s) = 0.768
    assert float(lp.grad) == pytest.approx(4 * s * (1 - s) * 2) and m["soft_clip_weight"] == pytest.approx(
        4 * s * (1 - s))


def test_gmpo_by_hand():
    old = torch.zeros(1, 2, dtype=torch.float64) - 1.0
    lp = (old + torch.tensor([[0.2, -0.6]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.float64)
    # A > 0: each log-ratio bounded above by 0.4 only: (0.2, -0.6), mean -0.2: loss -exp(-0.2) = -0.818731
    loss, m = gmpo_loss(lp, old, torch.ones(1, 2, dtype=torch.float64), mask)
    assert loss.item() == pytest.approx(-math.exp(-0.2)) and m["clip_frac_high"] == 0.5
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.full((1, 2), -math.exp(-0.2) / 2, dtype=torch.float64))
    # A < 0: bounded below by -0.4: (0.2, -0.4), mean -0.1: loss +exp(-0.1) = 0.904837; the clipped token has no
    # gradient
    lp.grad = None
    loss, m = gmpo_loss(lp, old, -torch.ones(1, 2, dtype=torch.float64), mask)
    assert loss.item() == pytest.approx(math.exp(-0.1)) and m["clip_frac_low"] == 0.5
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[math.exp(-0.1) / 2, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        gmpo_loss(lp, old, -torch.ones(1, 2, dtype=torch.float64), mask, agg="token-mean")


def test_clip_cov_by_hand():
    # ratio 1 everywhere; log-probs (-1, -3, -2, -2) around their mean -2, advantages (2, -2, 0, 0) around 0:
    # cov = (2 * 1, -2 * -1, 0, 0) = (2, 2, 0, 0): two candidates in (1, 5), none clipped by PPO
    lp = torch.tensor([[-1.0, -3.0, -2.0, -2.0]], dtype=torch.float64)
    adv, mask = torch.tensor([[2.0, -2.0, 0.0, 0.0]], dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64)
    # 0.25 of 4 tokens = 1 detached at random: per-token -A = (-2, 2, 0, 0); without token 0: 2/4; without 1: -2/4
    for seed in range(4):
        loss, m = clip_cov_loss(lp, lp, adv, mask, clip_cov_ratio=0.25, generator=torch.Generator().manual_seed(seed))
        assert loss.item() in (0.5, -0.5) and m["cov_clip_frac"] == 0.25
    loss, m = clip_cov_loss(lp, lp, adv, mask, clip_cov_ratio=0.5)  # both: nothing left
    assert loss.item() == 0.0 and m["cov_clip_frac"] == 0.5
    loss, m = clip_cov_loss(lp, lp, adv, mask, clip_cov_ratio=0.5, clip_cov_lb=2.5)  # window (2.5, 5): none
    assert loss.item() == 0.0 and m["cov_clip_frac"] == 0.0


def test_kl_cov_by_hand():
    lp = torch.tensor([[-1.0, -3.0, -2.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.tensor([[0.1, 0.2, 0.0, 0.0]], dtype=torch.float64)
    adv, mask = torch.tensor([[2.0, -1.0, -0.5, -0.5]], dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64)
    # cov = (2 * 1, -1 * -1, 0, 0) = (2, 1, 0, 0): the top 0.25 * 4 = 1 token is token 0, which gets + |0.1|
    # per token -A r: -2 e^0.1, e^0.2, 0.5, 0.5
    loss, m = kl_cov_loss(lp, old, adv, mask, kl_cov_ratio=0.25)
    assert loss.item() == pytest.approx((-2 * math.exp(0.1) + 0.1 + math.exp(0.2) + 1.0) / 4)
    assert m["kl_cov_frac"] == 0.25 and m["abs_kl"] == pytest.approx(0.3 / 4)
    loss.backward()
    # d/dlp: -A r / 4, plus sign(0.1) / 4 on token 0
    torch.testing.assert_close(lp.grad, torch.tensor([[(-2 * math.exp(0.1) + 1) / 4, math.exp(0.2) / 4,
                                                       0.125, 0.125]], dtype=torch.float64))


def test_dppo_by_hand():
    old, lp = logs(0.5, 0.01, 0.9), logs(0.7, 0.05, 0.5).requires_grad_(True)
    adv, mask = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    # TV 0.15: token 0 rose by 0.2 with A > 0: masked; token 1 rose by 0.04 only (a ratio of 5, which PPO's clip
    # would stop): trains; token 2 fell by 0.4 with A < 0: masked. Loss -A min(5, 20) log 0.05 / 3 = 4.992887
    loss, m = dppo_tv_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(-5 * math.log(0.05) / 3) and loss.item() == pytest.approx(4.992887, abs=1e-6)
    assert m["clip_frac_high"] == pytest.approx(1 / 3) and m["clip_frac_low"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -5 / 3, 0.0]], dtype=torch.float64))
    # binary KL 0.05: token 0 .5 log(.5/.7) + .5 log(.5/.3) = 0.087177 > 0.05 and it rose: masked; token 1
    # .01 log(.2) + .99 log(.99/.95) = 0.024737: trains; token 2 .9 log 1.8 + .1 log .2 = 0.368064 and it fell
    # with A < 0: masked. The same loss; a truncation at 2 caps token 1's weight: -2 log 0.05 / 3
    loss, m = dppo_kl_loss(lp, old, adv, mask, truncation=2.0)
    assert loss.item() == pytest.approx(-2 * math.log(0.05) / 3, rel=1e-6)
    assert m["truncated_frac"] == pytest.approx(1 / 3) and m["clip_frac_high"] == pytest.approx(1 / 3)


# -- the registry --------------------------------------------------------------------------------

NAMES = ["ppo_clip", "gspo", "cispo", "gmpo", "sapo", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl"]


def test_registry_reaches_every_loss():
    assert policy_loss_names() == NAMES
    assert get_policy_loss("ppo_clip") is policy_loss and get_policy_loss("gspo") is gspo_loss
    assert "dppo_kl" in POLICY_LOSSES
    with pytest.raises(ValueError, match="unknown policy loss 'cisp'; did you mean 'cispo'"):
        get_policy_loss("cisp")


@pytest.mark.parametrize("name", NAMES)
def test_every_loss_takes_the_common_arguments(name):
    old, lp, adv, mask = random_inputs(0, per_sequence_advantage=True)
    fn = get_policy_loss(name)
    agg = "seq-mean-token-mean"
    loss, metrics = fn(lp, old, adv, mask, agg=agg, norm_length=None, denominator=None, token_weights=None,
                       on_device=False)
    assert loss.dim() == 0 and all(isinstance(v, float) for v in metrics.values())
    assert {"approx_kl", "ratio_mean"} <= set(metrics)
    # masked positions change nothing (verl's invariance test: randomise them)
    lp2, adv2 = lp.clone(), adv.clone()
    lp2[mask == 0], adv2[mask == 0] = -0.3, 5.0
    torch.manual_seed(0)
    again, metrics2 = fn(lp2, old, adv2, mask, agg=agg)
    torch.manual_seed(0)
    first, _ = fn(lp, old, adv, mask, agg=agg)
    assert again.item() == pytest.approx(first.item(), rel=1e-12) and metrics2 == pytest.approx(metrics)
    # with token weights of 1 and a denominator equal to the count, nothing changes
    count = float((mask.sum(-1) > 0).sum())
    torch.manual_seed(0)
    same, _ = fn(lp, old, adv, mask, agg=agg, token_weights=torch.ones_like(lp), denominator=count)
    assert same.item() == pytest.approx(first.item(), rel=1e-9)
    on_device = fn(lp, old, adv, mask, agg=agg, on_device=True)[1]
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in on_device.values())
