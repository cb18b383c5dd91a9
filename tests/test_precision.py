"""Mixed precision: float32 master weights keep small updates; model and engine compute in the storage dtype."""

from __future__ import annotations

import pytest
import torch

from ctxrl.config import ConfigError, load_config
from ctxrl.engine.hf import HFEngine
from ctxrl.train.batch import collate
from ctxrl.train.learner import Learner, PPOSettings
from ctxrl.train.policy import Policy
from ctxrl.train.precision import MasterAdamW, Precision, make_optimizer, trainable_grads
from ctxrl.types import Episode, Task


def _batch(vocab: int) -> object:
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, p in ((24, 6), (18, 5), (30, 10), (12, 4)):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        rows.append(Episode(task=Task(id="t", prompt="p", answer="a"), input_ids=ids, loss_mask=[0] * p + [1] * (n - p),
                            behavior_logprobs=[0.0] * p + [-7.0] * (n - p), turn_index=[0] * n))
    return collate(rows, 0, advantages=[1.0, -1.0, 0.5, -0.5])


def _one_update(policy: Policy, lr: float) -> tuple[dict[str, float], torch.optim.Optimizer]:
    """Per trainable tensor, the fraction of its elements with a non-zero gradient that one AdamW step changed
    (in what the optimiser updates: the float32 masters, when it keeps them)."""
    optimizer = policy.precision.optimizer(policy.trainable_parameters(), lr=lr)
    learner = Learner(policy.model, optimizer, PPOSettings(mini_batches=1, micro_batch_size=2), pad_token_id=0,
                      precision=policy.precision)
    tensors = trainable_grads(optimizer)
    before = [t.detach().clone() for t in tensors]
    learner.update(_batch(policy.model.config.vocab_size))
    moved = {}
    for i, (t, b) in enumerate(zip(tensors, before)):
        has_grad = t.grad is not None and t.grad != 0
        if t.grad is not None and bool(has_grad.any()):
            moved[i] = float((t.detach() != b)[has_grad].float().mean())
    return moved, optimizer


def test_a_1e6_update_moves_every_fp32_master_weight_while_the_engine_copy_is_bf16(tiny_path):
    config = load_config(None, ["model.dtype=bfloat16", "model.device=cpu"])  # master weights: float32 (default)
    policy = Policy.load(config, "cpu")
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}  # it computes in bf16, as the engine
    engine_model = policy.engine_model()
    assert {p.dtype for p in engine_model.parameters()} == {torch.bfloat16}
    moved, optimizer = _one_update(policy, lr=1e-6)
    assert isinstance(optimizer, MasterAdamW)
    assert {t.dtype for t in optimizer.masters} == {torch.float32}
    assert len(moved) == len(list(policy.model.parameters()))  # every parameter had a gradient
    assert min(moved.values()) == 1.0, {k: v for k, v in moved.items() if v < 1.0}
    # the model holds the masters rounded to bf16, and the engine gets exactly those
    for p, m in zip(optimizer.model_params, optimizer.masters):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    engine = HFEngine(engine_model, pad_token_id=0)
    state, partial = policy.engine_state()
    engine.load_weights(state, version=1, partial=partial)
    for (name, a), b in zip(engine_model.named_parameters(), policy.model.parameters()):
        assert torch.equal(a, b.detach()), name


def test_training_bf16_weights_directly_loses_most_small_updates(tiny_path):
    """What train.master_weights=model costs: in bf16, a 1e-6 step rounds away on most weights."""
    policy = Policy.load(load_config(None, ["model.dtype=bfloat16", "model.device=cpu",
                                            "train.master_weights=model"]), "cpu")
    moved, optimizer = _one_update(policy, lr=1e-6)
    assert not isinstance(optimizer, MasterAdamW)
    assert sum(moved.values()) / len(moved) < 0.2


def test_master_gradients_accumulate_in_float32_and_resume_exactly(model):
    """Each backward's bf16 gradient is added into the float32 master gradient by the time backward returns; the
    state dict holds the masters, so a restored optimiser continues from the exact float32 values."""
    import copy

    policy = copy.deepcopy(model).to(torch.bfloat16)
    plain = copy.deepcopy(policy)  # the same weights, no optimiser hooks: its bf16 gradients, one backward each
    optimizer = Precision("bfloat16").optimizer(policy.parameters(), lr=1e-3)
    ids = torch.tensor([[5, 9, 12, 40, 7, 3]])
    bf16 = []
    for scale in (1.0, 3.0):
        plain.zero_grad(set_to_none=True)
        (scale * plain(input_ids=ids).logits.float().logsumexp(-1).mean()).backward()
        bf16.append([p.grad.clone() for p in plain.parameters()])
        (scale * policy(input_ids=ids).logits.float().logsumexp(-1).mean()).backward()
        assert all(p.grad is None for p in policy.parameters())  # moved into the masters
    for master, g1, g2 in zip(optimizer.masters, *bf16):
        assert master.grad.dtype == torch.float32
        assert torch.equal(master.grad, g1.float() + g2.float())
    optimizer.step()
    state = optimizer.state_dict()
    again = Precision("bfloat16").optimizer(copy.deepcopy(model).to(torch.bfloat16).parameters(), lr=1e-3)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.masters, optimizer.masters))
    assert all(torch.equal(a, b) for a, b in zip(again.model_params, optimizer.model_params))
    with pytest.raises(ValueError, match="master"):
        again.load_state_dict({k: v for k, v in state.items() if k != "masters"})
    optimizer.close()
    policy(input_ids=ids).logits.float().mean().backward()
    assert all(p.grad is not None for p in policy.parameters())  # closed: no more hooks


def test_float16_needs_loss_scaling_on_cuda_or_is_refused():
    with pytest.raises(ConfigError, match="train.master_weights=float32"):
        load_config(None, ["model.dtype=float16", "train.master_weights=model"])
    with pytest.raises(ConfigError, match="CUDA"):
        Precision("float16", "float32", "cpu")
    with pytest.raises(ConfigError, match="CUDA"):  # said by the config already when the device is named
        load_config(None, ["model.dtype=float16", "model.device=cpu"])
    assert Precision("float32", "float32", "cpu").scaler is None
    assert repr(Precision("bfloat16", "float32", "cpu")) == ("Precision(storage=torch.bfloat16, master=torch.float32, "
                                                             "loss_scaling=False)")


def test_loss_scaling_skips_an_overflowing_step_and_lowers_the_scale(model, tokenizer):
    """The GradScaler path, driven on CPU with a scaler forced on: an inf gradient skips the step, the scale halves."""
    import copy

    precision = Precision("float32", "float32", "cpu")
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    policy = copy.deepcopy(model)
    optimizer = make_optimizer(policy.parameters(), lr=1e-3)
    learner = Learner(policy, optimizer, PPOSettings(mini_batches=1), pad_token_id=0, precision=precision)
    batch = _batch(len(tokenizer))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    handle = policy.model.norm.weight.register_hook(lambda g: g * float("inf"))
    metrics = learner.mini_batch_step(batch)
    handle.remove()
    # the scale's search, not a failure: the step is skipped, the scale halves, nothing counts towards an abort
    assert metrics["overflow"] == 1.0 and metrics["skipped"] == 0.0 and metrics["loss_scale"] == 512.0
    assert learner.skipped_updates == 0
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())
    metrics = learner.mini_batch_step(batch)
    assert metrics["skipped"] == 0.0 and "overflow" not in metrics and metrics["loss_scale"] == 512.0
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())
    precision.scaler.update(0.5)  # a scale below 1 that still overflows: the gradients are broken, a failure
    handle = policy.model.norm.weight.register_hook(lambda g: g * float("inf"))
    metrics = learner.mini_batch_step(batch)
    handle.remove()
    assert metrics["skipped"] == 1.0 and learner.skipped_updates == 1


def test_fused_adamw_only_where_it_runs():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert not make_optimizer(params, lr=1e-3).defaults.get("fused")
    frozen = [torch.nn.Parameter(torch.zeros(3), requires_grad=False)]
    with pytest.raises(ValueError, match="no trainable"):
        make_optimizer(frozen, lr=1e-3)
