"""MoE models: the random-init Qwen3-MoE shapes (``ctxrl.models.shapes.MOE_SHAPES``), a micro one trained through
the learner's per-token log-prob function (forward and backward reach the router and the experts), and the router's
load-balancing loss as a figure (``ctxrl.models.moe``)."""

from __future__ import annotations

import logging

import pytest
import torch

from ctxrl.learner.logprobs import token_logprobs
from ctxrl.models.moe import is_moe, router_balance_loss
from ctxrl.models.shapes import MOE_SHAPES, random_model

log = logging.getLogger(__name__)


def test_the_qwen3_30b_a3b_shape_has_its_published_size():
    model = random_model("qwen3-30b-a3b", torch.bfloat16, "meta")  # nothing allocated
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and is_moe(model)
    assert sum(p.numel() for p in model.parameters()) == 30_532_122_624  # "30.5B" on its model card
    with pytest.raises(ValueError, match="choose one of .*qwen3-moe-test"):
        random_model("qwen3-moe-huge", torch.float32)


def test_a_micro_moe_trains_through_the_learners_logprobs(caplog):
    model = random_model("qwen3-moe-test", torch.float32, "cpu", seed=0)
    config = model.config
    assert config.num_experts == MOE_SHAPES["qwen3-moe-test"]["num_experts"] == 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (3, 10), generator=g)
    attention = torch.ones_like(ids)
    attention[2, 7:] = 0  # a padded row
    mask = attention[:, 1:].float()
    mask[:, :3] = 0  # a prompt

    chunked = token_logprobs(model, ids, attention, mask=mask, chunk=4)  # the learner's path: head in chunks
    full = token_logprobs(model, ids, attention, mask=mask, chunk=0)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    assert torch.all(chunked[mask.bool()] < 0) and torch.all(chunked[~mask.bool()] == 0)
    loss = -(chunked * mask).sum() / mask.sum()
    loss.backward()

    layer = model.model.layers[0].mlp
    router = next(p for name, p in layer.named_parameters() if "gate" in name and "proj" not in name)
    assert router.grad is not None and router.grad.abs().sum() > 0  # the router learns from the log-probs
    experts = [p for name, p in layer.named_parameters() if "experts" in name]
    assert experts and all(p.grad is not None for p in experts)
    assert sum(float(p.grad.abs().sum()) for p in experts) > 0

    with caplog.at_level(logging.INFO):
        balance = router_balance_loss(model, ids, attention)
        log.info("router load-balancing loss %.4f", balance)
    # E * sum_e f_e P_e with f_e = k/E and P_e = 1/E for an even load: k; a random-init router is nearly even
    assert balance == pytest.approx(config.num_experts_per_tok, rel=0.05)
    assert "load-balancing loss" in caplog.text


def test_a_dense_model_has_no_router_loss():
    model = random_model("qwen2-test", torch.float32, "meta")
    assert not is_moe(model)
    assert router_balance_loss(model, torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)) is None
