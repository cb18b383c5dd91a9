"""ECHO's world-model loss on environment tokens (ctxrl.algo.world_model), by hand.

verl has no such function in ``core_algos.py`` (ECHO lives in a verl-recipe); the reference is the paper's
formula: ``coef * mean over environment tokens of -log pi``.
"""

from __future__ import annotations

import math

import pytest
import torch

from ctxrl.algo.world_model import world_model_loss

# one episode: prompt, 2 sampled tokens, 3 tool-output tokens, 1 sampled token; one with 1 tool token
LOGPROBS = torch.tensor([[-9.0, -0.5, -0.7, -1.0, -2.0, -3.0, -0.1], [-9.0, -0.2, -4.0, 0.0, 0.0, 0.0, 0.0]],
                        dtype=torch.float64)
ENV = torch.tensor([[0, 0, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0, 0]], dtype=torch.float64)
POLICY = torch.tensor([[0, 1, 1, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0, 0]], dtype=torch.float64)


def test_world_model_loss_by_hand():
    lp = LOGPROBS.clone().requires_grad_(True)
    loss, m = world_model_loss(lp, ENV, coef=0.05, policy_mask=POLICY)
    # environment tokens' NLL: 1, 2, 3 and 4; token mean 10 / 4 = 2.5; times 0.05 = 0.125
    assert float(loss.detach()) == pytest.approx(0.125) and m == {"env_nll": 2.5, "env_tokens": 4.0}
    loss.backward()
    # d/dlp = -coef / 4 on environment tokens, 0 on the prompt and on sampled tokens
    torch.testing.assert_close(lp.grad, -0.05 / 4 * ENV)
    # per sequence (rLLM's normalisation): (6 / 3 + 4 / 1) / 2 = 3, times 0.05
    loss, _ = world_model_loss(LOGPROBS, ENV, coef=0.05, agg="seq-mean-token-mean")
    assert float(loss) == pytest.approx(0.15)
    # its own denominator under gradient accumulation (here: 8 environment tokens in the whole mini-batch)
    loss, _ = world_model_loss(LOGPROBS, ENV, coef=1.0, denominator=8)
    assert float(loss) == pytest.approx(10 / 8)


def test_world_model_loss_ignores_everything_else_and_checks_the_masks():
    noisy = LOGPROBS.clone()
    noisy[ENV == 0] = float("nan")  # nothing outside the environment tokens is read
    loss, _ = world_model_loss(noisy, ENV)
    assert float(loss) == pytest.approx(0.125)
    assert float(world_model_loss(LOGPROBS, ENV, coef=0.0)[0]) == 0.0
    empty, m = world_model_loss(LOGPROBS, torch.zeros_like(ENV))
    assert float(empty) == 0.0 and m["env_tokens"] == 0.0 and not math.isnan(m["env_nll"])
    with pytest.raises(ValueError, match="share tokens"):
        world_model_loss(LOGPROBS, ENV, policy_mask=POLICY + ENV)
    with pytest.raises(ValueError, match=">= 0"):
        world_model_loss(LOGPROBS, ENV, coef=-1.0)
    with pytest.raises(ValueError, match="must be equal"):
        world_model_loss(LOGPROBS[:, :3], ENV)
