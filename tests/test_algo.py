"""Advantages, PPO loss, aggregation, KL estimators and entropy, checked against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from ctxrl.algo import AGG_MODES, aggregate, entropy_from_logits, grpo_advantages, kl_penalty, policy_loss

# -- advantages ----------------------------------------------------------------------------------


def test_grpo_hand_example_std_normalized():
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = grpo_advantages(rewards, groups)
    std = math.sqrt(1 / 3)  # Bessel: sum of squares 4 * 0.25 = 1, over n - 1 = 3
    a = 0.5 / (std + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0, 0, 0, 0])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    assert abs(float(adv[0]) - 0.866025) < 1e-5


def test_grpo_hand_example_centred_only():
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = grpo_advantages(rewards, groups, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_grpo_interleaved_groups_and_singleton():
    rewards = torch.tensor([3.0, 1.0, 7.0, 5.0, 9.0])
    groups = torch.tensor([2, 5, 2, 5, 8])  # group 8 has one member
    adv = grpo_advantages(rewards, groups, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([-2.0, -2.0, 2.0, 2.0, 0.0]))
    adv = grpo_advantages(rewards, groups)
    s = math.sqrt(8.0)  # (4 + 4) / 1
    unit = 2 / (s + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([-unit, -unit, unit, unit, 0.0]))


def test_grpo_single_member_group_is_zero():
    adv = grpo_advantages(torch.tensor([4.0]), torch.tensor([0]))
    assert adv.tolist() == [0.0]


def test_grpo_shape_mismatch_raises():
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError):
        grpo_advantages(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long))


# -- policy loss ---------------------------------------------------------------------------------

RATIO = torch.tensor([[1.1, 1.5, 3.0], [0.5, 4.0, 0.9]], dtype=torch.float64)
ADV = torch.tensor([[1.0, 1.0, 5.0], [-1.0, -1.0, 0.5]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -0.7]], dtype=torch.float64)


def _logprobs():
    return (OLD + RATIO.log()).clone().requires_grad_(True)


def test_policy_loss_hand_example():
    lp = _logprobs()
    loss, metrics = policy_loss(lp, OLD, ADV, MASK, clip_low=0.2, clip_high=0.2)
    # per token: unclipped -1.1; clipped-high -1.2; masked; clipped-low 0.8; unclipped 4.0; -0.45
    expected = (-1.1 - 1.2 + 0.8 + 4.0 - 0.45) / 5
    assert abs(float(loss.detach()) - expected) < 1e-9
    assert abs(expected - 0.41) < 1e-12
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5)  # ratio 1.5, A > 0 (3.0 is masked)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 5)  # ratio 0.5, A < 0 (4.0 is not low)
    assert metrics["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 4.0 + 0.9) / 5)
    logr = RATIO.log()
    assert metrics["approx_kl"] == pytest.approx(float((0.5 * logr**2 * MASK).sum() / 5))
    loss.backward()
    # d loss / d logprob = -A * ratio / 5 where unclipped, 0 where clipped or masked.
    expected_grad = torch.tensor([[-1.1 / 5, 0.0, 0.0], [0.0, 4.0 / 5, -0.45 / 5]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected_grad, atol=1e-12, rtol=0)


def test_policy_loss_masked_tokens_ignored():
    lp = _logprobs().detach()
    base, _ = policy_loss(lp, OLD, ADV, MASK)
    adv2, lp2 = ADV.clone(), lp.clone()
    adv2[0, 2] = -1e6
    lp2[0, 2] = 50.0
    other, metrics = policy_loss(lp2, OLD, adv2, MASK)
    assert float(other) == pytest.approx(float(base), abs=1e-12)
    assert metrics["clip_frac_low"] == pytest.approx(0.2)


def test_policy_loss_asymmetric_clip_high():
    loss, metrics = policy_loss(_logprobs(), OLD, ADV, MASK, clip_low=0.2, clip_high=0.28)
    expected = (-1.1 - 1.28 + 0.8 + 4.0 - 0.45) / 5
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-9)
    assert metrics["clip_frac_high"] == pytest.approx(0.2)
    # the low side still clips at 0.8, not at 0.72
    loss2, _ = policy_loss(_logprobs(), OLD, ADV, MASK, clip_low=0.5, clip_high=0.28)
    assert float(loss2.detach()) == pytest.approx((-1.1 - 1.28 + 0.5 + 4.0 - 0.45) / 5, abs=1e-9)


def test_policy_loss_dual_clip():
    lp = _logprobs()
    loss, _ = policy_loss(lp, OLD, ADV, MASK, dual_clip=3.0)
    # ratio 4.0 with A = -1: max(4.0, 1.2) = 4.0 capped at -3 * A = 3.0
    expected = (-1.1 - 1.2 + 0.8 + 3.0 - 0.45) / 5
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-9)
    loss.backward()
    assert float(lp.grad[1, 1]) == 0.0  # the capped token carries no gradient
    # positive advantages are never dual-clipped
    big = torch.tensor([[10.0]], dtype=torch.float64)
    l_pos, _ = policy_loss(big.log(), torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
                           torch.ones(1, 1, dtype=torch.float64), dual_clip=3.0)
    assert float(l_pos) == pytest.approx(-1.2)
    with pytest.raises(ValueError):
        policy_loss(lp.detach(), OLD, ADV, MASK, dual_clip=1.0)


def test_policy_loss_seq_mean_token_mean():
    loss, _ = policy_loss(_logprobs(), OLD, ADV, MASK, agg="seq-mean-token-mean")
    expected = ((-1.1 - 1.2) / 2 + (0.8 + 4.0 - 0.45) / 3) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-9)


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    lp = torch.randn(3, 4)
    adv = torch.randn(3, 4)
    mask = torch.ones(3, 4)
    loss, m = policy_loss(lp, lp, adv, mask)
    assert float(loss.detach()) == pytest.approx(-float(adv.mean()), abs=1e-6)
    assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0 and m["approx_kl"] == 0.0


# -- aggregation ---------------------------------------------------------------------------------

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AMASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # last row fully masked


def test_aggregate_modes_by_hand():
    assert float(aggregate(VALUES, AMASK, "token-mean")) == pytest.approx(18 / 5)
    assert float(aggregate(VALUES, AMASK, "seq-mean-token-sum")) == pytest.approx((3 + 15) / 2)
    assert float(aggregate(VALUES, AMASK, "seq-mean-token-mean")) == pytest.approx((1.5 + 5.0) / 2)
    norm4 = float(aggregate(VALUES, AMASK, "seq-mean-token-sum-norm", norm_length=4))
    assert norm4 == pytest.approx((3 / 4 + 15 / 4) / 2)
    assert set(AGG_MODES) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}


def test_aggregate_denominator_override():
    assert float(aggregate(VALUES, AMASK, "token-mean", denominator=10)) == pytest.approx(18 / 10)
    assert float(aggregate(VALUES, AMASK, "seq-mean-token-sum", denominator=4)) == pytest.approx(18 / 4)
    assert float(aggregate(VALUES, AMASK, "seq-mean-token-mean", denominator=5)) == pytest.approx(6.5 / 5)
    norm2 = float(aggregate(VALUES, AMASK, "seq-mean-token-sum-norm", norm_length=2, denominator=3))
    assert norm2 == pytest.approx(9 / 3)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_all_masked_is_zero(mode):
    values = torch.randn(2, 3, requires_grad=True)
    out = aggregate(values, torch.zeros(2, 3), mode, norm_length=5)
    assert float(out.detach()) == 0.0 and not math.isnan(float(out.detach()))
    out.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))


def test_aggregate_errors():
    with pytest.raises(ValueError):
        aggregate(VALUES, AMASK, "sum")
    with pytest.raises(ValueError):
        aggregate(VALUES, AMASK, "seq-mean-token-sum-norm")


# -- KL ------------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5, -1.2], dtype=torch.float64)
    x = (lp - ref).tolist()  # [0.5, -1.0, 0.0, -1.8]
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx(x)
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.5 * v * v for v in x])
    k3 = kl_penalty(lp, ref, "k3").tolist()
    assert k3 == pytest.approx([math.exp(-v) - 1 + v for v in x])
    assert k3[2] == 0.0 and all(v >= 0 for v in k3)
    assert k3[0] == pytest.approx(0.1065306597, abs=1e-9)


def test_kl_k3_clamped():
    lp = torch.tensor([40.0, -40.0])
    out = kl_penalty(lp, torch.zeros(2), "k3")
    assert out.tolist() == [10.0, 10.0]


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="k9"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k9")


# -- entropy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_entropy_from_logits(chunk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    direct = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    out = entropy_from_logits(logits, chunk_size=chunk)
    assert out.shape == (2, 5)
    torch.testing.assert_close(out, direct, atol=1e-6, rtol=0)


def test_entropy_uniform_and_one_hot():
    logits = torch.zeros(3, 8)
    logits[2, 0] = 1e4
    out = entropy_from_logits(logits, chunk_size=2)
    assert out[0].item() == pytest.approx(math.log(8))
    assert out[1].item() == pytest.approx(math.log(8))
    assert out[2].item() == pytest.approx(0.0, abs=1e-6)


def test_rloo_hand_example():
    from ctxrl.algo.advantages import rloo_advantages

    # group 0: [1, 0, 0, 1]: A_0 = 1 - mean(0, 0, 1) = 2/3; group 1: [3, 1]: A = +-2; group 2 alone: 0
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 1.0, 1.0, 7.0])
    groups = torch.tensor([0, 1, 0, 0, 0, 1, 2])
    adv = rloo_advantages(rewards, groups)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, 2.0, -2 / 3, -2 / 3, 2 / 3, -2.0, 0.0]))
    # leave-one-out by definition, on random rewards
    g = torch.Generator().manual_seed(0)
    r = torch.randn(6, generator=g)
    loo = torch.stack([r[i] - torch.cat([r[:i], r[i + 1:]]).mean() for i in range(6)])
    torch.testing.assert_close(rloo_advantages(r, torch.zeros(6, dtype=torch.long)), loo)
    with pytest.raises(ValueError):
        rloo_advantages(torch.zeros(3), torch.zeros(2))


def test_gspo_hand_example_and_gradient():
    from ctxrl.algo.losses import gspo_loss

    lp = torch.tensor([[-1.0, -2.0, -5.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.ones(1, 3)
    loss, m = gspo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    s = math.exp(-0.1)  # mean of (0.2, -0.4): the masked token never counts
    assert loss.item() == pytest.approx(-s, rel=1e-6)
    assert m["ratio_mean"] == pytest.approx(s, rel=1e-6)
    loss.backward()
    # d/dlp_t of -s over a 2-token mean: -s / 2 per sampled token, 0 on the masked one
    torch.testing.assert_close(lp.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))
    # the paper's clip (3e-4 / 4e-4): s = 0.905 < 1 - 3e-4; with A < 0 the clipped term binds
    lp.grad = None
    loss, m = gspo_loss(lp, old, -adv, mask)
    assert loss.item() == pytest.approx(1 - 3e-4, rel=1e-6)
    assert m["clip_frac_low"] == 1.0
    loss.backward()
    assert lp.grad.abs().sum() == 0


def test_gspo_gradient_is_the_sequence_ratio_gradient():
    from ctxrl.algo.losses import gspo_loss

    g = torch.Generator().manual_seed(3)
    lp = (torch.randn(4, 7, generator=g) * 0.05 - 1).requires_grad_()
    old = lp.detach() + torch.randn(4, 7, generator=g) * 0.05
    mask = (torch.rand(4, 7, generator=g) < 0.7).float()
    adv = torch.randn(4, generator=g).unsqueeze(1).expand(4, 7)
    loss, _ = gspo_loss(lp, old, adv, mask, clip_low=10.0, clip_high=10.0)  # no clipping
    loss.backward()
    ours = lp.grad.clone()
    lp.grad = None
    seq = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
    (-(adv[:, 0] * seq).mean()).backward()
    torch.testing.assert_close(ours, lp.grad)
