"""REINFORCE++ returns, GAE and masked whitening: hand-computed values, multi-turn masking,
metamorphic invariance to mask-0 inputs, and single-turn parity with verl's recursions."""

from __future__ import annotations

import pytest
import torch

from ctxrl.algo.returns import gae_advantages, masked_mean, masked_whiten, reinforce_pp_returns

# prompt, two sampled tokens (turn 0), two observation tokens, two sampled (turn 1), padding
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)


def test_reinforce_pp_returns_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0, -3.0, 0.0, 2.0, 7.0]])  # 5, -3, 7 sit on mask-0 tokens
    returns = reinforce_pp_returns(rewards, MASK, gamma=0.5)
    # t6: 2; t5: 0.5*2 = 1; (t4, t3 skipped, not discounted); t2: 1 + 0.5*1 = 1.5; t1: 0.5*1.5
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.75, 1.5, 0.0, 0.0, 1.0, 2.0, 0.0]]))
    # gamma = 1: every sampled token's return is the sum of the rewards from it on
    torch.testing.assert_close(reinforce_pp_returns(rewards, MASK, 1.0),
                               torch.tensor([[0.0, 3.0, 3.0, 0.0, 0.0, 2.0, 2.0, 0.0]]))


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), torch.tensor([[1.0, 2.0, 3.0, 0.0]]),
                               atol=1e-6, rtol=0)
    assert masked_mean(x, mask) == 2.0
    # one live entry: variance 0, no NaN; nothing live: zeros
    assert torch.isfinite(masked_whiten(x, torch.tensor([[0, 1, 0, 0]]))).all()
    assert masked_whiten(x, torch.zeros(1, 4)).abs().sum() == 0
    assert masked_mean(x, torch.zeros(1, 4)) == 0


def test_gae_by_hand():
    mask = torch.tensor([[1, 1, 0, 1]])
    rewards = torch.tensor([[0.0, 0.0, 9.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 7.0, 0.8]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # d3 = 1 - 0.8 = 0.2; d1 = 0.9*0.8 - 0.6 = 0.12, A1 = 0.12 + 0.72*0.2 = 0.264;
    # d0 = 0.9*0.6 - 0.5 = 0.04, A0 = 0.04 + 0.72*0.264 = 0.23008 (t2's value and reward never enter)
    torch.testing.assert_close(adv, torch.tensor([[0.23008, 0.264, 0.0, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.73008, 0.864, 0.0, 1.0]]))
    # gamma = lam = 1: A = (sum of future rewards) - V
    adv1, ret1 = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv1, torch.tensor([[0.5, 0.4, 0.0, 0.2]]))
    torch.testing.assert_close(ret1, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))


def _random_multiturn(seed: int, b: int = 5, t: int = 17):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) < 0.6).float()
    mask[:, 0] = 0  # the prompt
    return mask, torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)


@pytest.mark.parametrize("seed", range(5))
def test_mask_zero_inputs_never_matter(seed):
    mask, rewards, values = _random_multiturn(seed)
    g = torch.Generator().manual_seed(100 + seed)
    noisy_r = torch.where(mask.bool(), rewards, torch.randn(rewards.shape, generator=g) * 50)
    noisy_v = torch.where(mask.bool(), values, torch.randn(values.shape, generator=g) * 50)
    garbage = torch.where(mask.bool(), rewards, torch.full_like(rewards, float("nan")))
    for r in (noisy_r, garbage):
        torch.testing.assert_close(reinforce_pp_returns(r, mask, 0.9), reinforce_pp_returns(rewards, mask, 0.9))
        torch.testing.assert_close(masked_whiten(r, mask), masked_whiten(rewards, mask))
    a, r1 = gae_advantages(rewards, values, mask, 0.95, 0.9)
    b, r2 = gae_advantages(noisy_r, noisy_v, mask, 0.95, 0.9)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(r1, r2)
    for out in (a, r1, reinforce_pp_returns(rewards, mask, 0.9)):
        assert out[mask == 0].abs().sum() == 0


def _verl_style_returns(rewards, mask, gamma):
    # The single-response recursion as the common references write it: reset after each
    # mask-0 token.
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
        running = running * mask[:, t]
    return out


def _verl_style_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(rewards)
    next_v = torch.zeros(rewards.shape[0])
    last = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        new = delta + gamma * lam * last
        next_v = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_v
        last = new * mask[:, t] + (1 - mask[:, t]) * last
        adv[:, t] = last
    return adv, adv + values


@pytest.mark.parametrize("seed", range(4))
def test_single_turn_parity_with_reference_recursions(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 12
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()  # response, then padding
    rewards = torch.randn(b, t, generator=g) * mask
    values = torch.randn(b, t, generator=g)
    live = mask.bool()
    torch.testing.assert_close(reinforce_pp_returns(rewards, mask, 0.97)[live],
                               _verl_style_returns(rewards, mask, 0.97)[live])
    ours_a, ours_r = gae_advantages(rewards, values, mask, 0.99, 0.95)
    ref_a, ref_r = _verl_style_gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(ours_a[live], ref_a[live])
    torch.testing.assert_close(ours_r[live], ref_r[live])


def test_multi_turn_differs_from_reset_recursion_on_purpose():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 0.0]])
    ours = reinforce_pp_returns(rewards, MASK, 1.0)
    reset = _verl_style_returns(rewards, MASK, 1.0)
    assert ours[0, 2] == 3.0 and reset[0, 2] == 1.0  # turn 0 is credited with turn 1's reward


def test_shape_errors():
    with pytest.raises(ValueError, match="must be equal"):
        reinforce_pp_returns(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="values"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(3), torch.zeros(2, 3))


def test_value_loss_by_hand():
    from ctxrl.algo.value import value_loss

    values = torch.tensor([[1.0, 0.5, 9.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.8, 0.5, 0.0, 1.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    loss, m = value_loss(values, old, returns, mask, clip=0.1)
    # t0: V=1 (moved 0.2 > 0.1): plain (1-1)^2 = 0, clipped (0.9-1)^2 = 0.01 -> 0.005
    # t1: V=old=0.5: 0.25 -> 0.125; t3: plain 4, clipped (1.1)^2 = 1.21 -> max 4 -> 2; mean over 3
    assert loss.item() == pytest.approx((0.005 + 0.125 + 2.0) / 3)
    assert m["vf_clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # t0's binding term is the clipped one, which has no gradient in V (clip active); t2 is masked
    assert values.grad[0, 0] == 0 and values.grad[0, 2] == 0
    assert values.grad[0, 1] == pytest.approx((0.5 - 1.0) / 3)
    assert values.grad[0, 3] == pytest.approx(2.0 / 3)
