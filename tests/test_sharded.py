"""Sharded training with FSDP2 (``ctxrl.distributed.sharded``, ``sharded_checkpoint``, ``sharded_memory``): two
processes over gloo on the CPU take exactly the one-process update, resume exactly from a sharded checkpoint, whose
weights and optimiser state also load in one process (another world size); the gathered full weights are the
unsharded state dict; the per-rank memory plan's figures are derived by hand."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from ctxrl.distributed.sharded_memory import GIB, ShardedMemoryError, plan_sharded_memory

LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-2, 0.1, 0.5  # a low clip, so the sharded norm decides every step
ROWS, TOKENS = 5, 12
SHARES = [  # the rows of each step's batch each rank trains on: uneven, and a rank idle at step 3
    ([0, 1], [2, 3, 4]),
    ([0], [1, 2, 3, 4]),
    ([0, 1, 2, 3, 4], []),
    ([3, 4], [0, 1, 2]),
    ([0, 2, 4], [1, 3]),
]
CHECKPOINT_AFTER = 3


def _model(seed: int = 0):
    """A Llama-style decoder of 4,672 parameters, its embeddings tied to the output head, in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).float()


def _batch(step: int):
    """Step ``step``'s rows: random ids, right padding after a random length, the first 3 tokens a prompt (mask 0),
    an advantage per row."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, 64, (ROWS, TOKENS), generator=g)
    lengths = torch.randint(5, TOKENS + 1, (ROWS,), generator=g)
    attention = (torch.arange(TOKENS) < lengths[:, None]).long()
    ids = ids * attention
    loss_mask = attention[:, 1:].float()
    loss_mask[:, :2] = 0
    advantages = torch.randn(ROWS, generator=g)
    return ids, attention, loss_mask, advantages


def _flat(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def _unsharded_steps(model, optimizer, steps) -> None:
    """The one-process update of the whole batch, the same loss, norm, clipping and AdamW."""
    from ctxrl.distributed.sharded import masked_token_loss
    from ctxrl.learner.logprobs import token_logprobs

    for step in steps:
        ids, attention, loss_mask, advantages = _batch(step)
        optimizer.zero_grad(set_to_none=True)
        logprobs = token_logprobs(model, ids, attention, mask=loss_mask, chunk=0)
        masked_token_loss(logprobs, loss_mask, float(loss_mask.sum()), advantages).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=False)
        torch.nn.utils.clip_grads_with_norm_(params, MAX_GRAD_NORM, norm, foreach=False)
        optimizer.step()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from ctxrl.distributed.sharded import (
        full_state_layers,
        shard_model,
        sharded_optimizer,
        sharded_update,
        sync_engine,
    )
    from ctxrl.distributed.sharded_checkpoint import load_sharded, save_sharded
    from ctxrl.engine.hf import HFEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        def gather(model):
            pieces = list(full_state_layers(model))
            return {k: v for piece in pieces for k, v in piece.items()}, [sorted(p) for p in pieces]

        def steps(model, optimizer, numbers):
            figures = []
            for step in numbers:
                ids, attention, loss_mask, advantages = _batch(step)
                mine = torch.tensor(SHARES[step][rank], dtype=torch.long)
                figures.append(sharded_update(model, optimizer, ids[mine], attention[mine], loss_mask[mine],
                                              advantages=advantages[mine], max_grad_norm=MAX_GRAD_NORM))
            return figures

        result = {}
        model = shard_model(_model())
        optimizer = sharded_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
        result["initial"], result["pieces"] = gather(model)
        save_sharded(f"{out}.replaced", model, step=0)  # weights only; replaced after step 3
        result["figures"] = steps(model, optimizer, range(CHECKPOINT_AFTER))
        result["after_3"], _ = gather(model)
        engine = HFEngine(_model(seed=3), pad_token_id=0)  # a rollout engine's own unsharded copy
        result["engine_tensors"] = sync_engine(model, engine, version=CHECKPOINT_AFTER, decodes=rank == 0)
        result["engine"], result["engine_version"] = _flat(engine.model.state_dict()), engine.policy_version
        save_sharded(f"{out}.checkpoint", model, optimizer, step=CHECKPOINT_AFTER)
        save_sharded(f"{out}.replaced", model, optimizer, step=CHECKPOINT_AFTER)
        result["figures"] += steps(model, optimizer, range(CHECKPOINT_AFTER, len(SHARES)))
        result["uninterrupted"], _ = gather(model)

        resumed = shard_model(_model(seed=1))  # other weights, so the load must overwrite every one
        resumed_optimizer = sharded_optimizer(resumed, lr=LR, weight_decay=WEIGHT_DECAY)
        result["info"] = load_sharded(f"{out}.checkpoint", resumed, resumed_optimizer)
        result["resumed_figures"] = steps(resumed, resumed_optimizer, range(CHECKPOINT_AFTER, len(SHARES)))
        result["resumed"], _ = gather(resumed)
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    mp.start_processes(_rank, args=(2, f"file://{tmp / 'rendezvous'}", str(tmp / "out")), nprocs=2, join=True,
                       start_method="spawn")
    return tmp, [torch.load(tmp / f"out.{r}") for r in range(2)]


@pytest.fixture(scope="module")
def unsharded():
    """The one-process run's weights at the checkpoint and at the end."""
    model = _model()
    optimizer = _adamw(model)
    initial = _flat(model.state_dict())
    _unsharded_steps(model, optimizer, range(CHECKPOINT_AFTER))
    after_3 = _flat(model.state_dict())
    _unsharded_steps(model, optimizer, range(CHECKPOINT_AFTER, len(SHARES)))
    return {"initial": initial, "after_3": after_3, "end": _flat(model.state_dict())}


def _assert_weights(got: dict, want: dict, **tolerance) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        if tolerance:
            torch.testing.assert_close(got[name], want[name], msg=name, **tolerance)
        else:
            assert torch.equal(got[name], want[name]), name


@pytest.mark.slow  # (two gloo processes importing torch and transformers: 13-54 s for the group)
def test_full_weights_gather_equals_the_unsharded_state_dict_layer_by_layer(two_ranks, unsharded):
    _, ranks = two_ranks
    for result in ranks:
        _assert_weights(result["initial"], unsharded["initial"])  # exact: the same init, gathered
        # one piece per decoder layer, the embeddings first, the final norm and the (tied) head last
        assert result["pieces"][0] == ["model.embed_tokens.weight"]
        assert all(name.startswith(f"model.layers.{i}.") for i in (0, 1) for name in result["pieces"][1 + i])
        assert result["pieces"][3] == ["lm_head.weight", "model.norm.weight"]
        assert torch.equal(result["initial"]["lm_head.weight"], result["initial"]["model.embed_tokens.weight"])


@pytest.mark.slow  # (two gloo processes importing torch and transformers: 13-54 s for the group)
def test_the_engine_sync_gives_the_decoding_rank_the_full_weights(two_ranks):
    _, ranks = two_ranks
    leader, follower = ranks
    assert leader["engine_tensors"] == len(leader["after_3"]) and leader["engine_version"] == CHECKPOINT_AFTER
    _assert_weights(leader["engine"], leader["after_3"])
    assert follower["engine_tensors"] == 0  # it took part in the gathers only
    assert not torch.equal(follower["engine"]["model.norm.weight"], leader["after_3"]["model.norm.weight"])


@pytest.mark.slow  # (two gloo processes importing torch and transformers: 13-54 s for the group)
def test_sharded_update_equals_the_unsharded_one_after_3_steps(two_ranks, unsharded):
    _, ranks = two_ranks
    before = unsharded["initial"]["model.layers.0.mlp.up_proj.weight"]
    assert not torch.allclose(unsharded["after_3"]["model.layers.0.mlp.up_proj.weight"], before)
    for result in ranks:
        _assert_weights(result["after_3"], unsharded["after_3"], atol=1e-6, rtol=1e-6)
        _assert_weights(result["uninterrupted"], unsharded["end"], atol=1e-6, rtol=1e-6)
        assert all(f["grad_norm"] > MAX_GRAD_NORM for f in result["figures"])  # every step clipped
    assert ranks[0]["figures"] == ranks[1]["figures"]  # loss, norm and tokens agree across ranks
    _assert_weights(ranks[0]["uninterrupted"], ranks[1]["uninterrupted"])


@pytest.mark.slow  # (two gloo processes importing torch and transformers: 13-54 s for the group)
def test_resume_from_a_sharded_checkpoint_is_exact(two_ranks):
    tmp, ranks = two_ranks
    for result in ranks:
        assert result["info"] == {"step": CHECKPOINT_AFTER, "world_size": 2, "optimizer": True}
        _assert_weights(result["resumed"], result["uninterrupted"])  # bit for bit
        assert result["resumed_figures"] == result["figures"][CHECKPOINT_AFTER:]
    assert not (tmp / "out.checkpoint.tmp").exists()


@pytest.mark.slow  # (two gloo processes importing torch and transformers: 13-54 s for the group)
def test_a_two_rank_checkpoint_loads_in_one_process_and_trains_on(two_ranks, unsharded):
    from ctxrl.distributed.sharded_checkpoint import load_sharded

    tmp, ranks = two_ranks
    model = _model(seed=2)
    optimizer = _adamw(model)
    load_sharded(tmp / "out.checkpoint", model, optimizer)  # world size 1, no process group, unsharded
    _assert_weights(_flat(model.state_dict()), ranks[0]["after_3"])
    _unsharded_steps(model, optimizer, range(CHECKPOINT_AFTER, len(SHARES)))  # AdamW's moments came back too
    _assert_weights(_flat(model.state_dict()), unsharded["end"], atol=1e-6, rtol=1e-6)


def _one_sharded_rank(rank: int, init: str, checkpoint: str, out: str) -> None:
    """Load the 2-rank checkpoint into a model sharded over a group of 1 (FSDP2 at world size 1), train on."""
    import torch.distributed as dist

    from ctxrl.distributed.sharded import full_state_layers, shard_model, sharded_optimizer, sharded_update
    from ctxrl.distributed.sharded_checkpoint import load_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1)
    try:
        model = shard_model(_model(seed=2))
        optimizer = sharded_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
        load_sharded(checkpoint, model, optimizer)
        loaded = {k: v for piece in full_state_layers(model) for k, v in piece.items()}
        for step in range(CHECKPOINT_AFTER, len(SHARES)):
            ids, attention, loss_mask, advantages = _batch(step)
            sharded_update(model, optimizer, ids, attention, loss_mask, advantages=advantages,
                           max_grad_norm=MAX_GRAD_NORM)
        end = {k: v for piece in full_state_layers(model) for k, v in piece.items()}
        torch.save({"loaded": loaded, "end": end}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_two_rank_checkpoint_loads_on_one_sharded_rank(two_ranks, unsharded):
    tmp, ranks = two_ranks
    mp.start_processes(_one_sharded_rank, args=(f"file://{tmp / 'rendezvous-1'}", str(tmp / "out.checkpoint"),
                                                str(tmp / "one-rank")), nprocs=1, join=True, start_method="spawn")
    result = torch.load(tmp / "one-rank")
    _assert_weights(result["loaded"], ranks[0]["after_3"])
    _assert_weights(result["end"], unsharded["end"], atol=1e-6, rtol=1e-6)


def _moe_model():
    from ctxrl.models.shapes import random_model

    return random_model("qwen3-moe-test", torch.float32, "cpu", seed=0)  # (the experts' grouped matmul: no float64)


def _moe_rank(rank: int, world: int, init: str, out: str) -> None:
    """3 sharded steps of the micro Qwen3-MoE (its experts' weights sharded like any other)."""
    import torch.distributed as dist

    from ctxrl.distributed.sharded import full_state_layers, shard_model, sharded_optimizer, sharded_update

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = shard_model(_moe_model())
        optimizer = sharded_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
        for step in range(CHECKPOINT_AFTER):
            ids, attention, loss_mask, advantages = _batch(step)
            mine = torch.tensor(SHARES[step][rank], dtype=torch.long)
            sharded_update(model, optimizer, ids[mine], attention[mine], loss_mask[mine], advantages=advantages[mine],
                           max_grad_norm=MAX_GRAD_NORM)
        torch.save({k: v for piece in full_state_layers(model) for k, v in piece.items()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_sharded_moe_update_equals_the_unsharded_one(tmp_path):
    mp.start_processes(_moe_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "moe")), nprocs=2,
                       join=True, start_method="spawn")
    model = _moe_model()
    before = _flat(model.state_dict())
    _unsharded_steps(model, _adamw(model), range(CHECKPOINT_AFTER))
    want = _flat(model.state_dict())
    experts = next(name for name in want if "experts" in name)
    assert not torch.equal(want[experts], before[experts])  # the experts trained
    for rank in range(2):
        got = torch.load(tmp_path / f"moe.{rank}")
        # 18 of 600,000 elements (experts' and the head's, with near-zero gradients) differ by up to 1.1e-5: the
        # experts sum over other token sets, rounding differently, and AdamW scales a near-zero gradient's rounding
        # up to a full step of lr (1e-2). The rest agree to 1e-6, as the dense model's all do.
        _assert_weights(got, want, atol=3e-5, rtol=0)
        off = sum(int(((got[k] - want[k]).abs() > 1e-6).sum()) for k in want)
        assert off <= 1e-4 * sum(v.numel() for v in want.values()), off


def test_gathered_weights_are_copies_even_on_one_rank(tmp_path):
    """On a mesh of one rank ``full_tensor`` is the live shard itself; the gathered pieces must not change when the
    optimiser steps (in this process: a group of 1, destroyed after)."""
    import torch.distributed as dist

    from ctxrl.distributed.sharded import full_state_layers, shard_model, sharded_optimizer, sharded_update

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = shard_model(_model())
        optimizer = sharded_optimizer(model, lr=LR)
        before = {k: v for piece in full_state_layers(model) for k, v in piece.items()}
        kept = {k: v.clone() for k, v in before.items()}
        ids, attention, loss_mask, advantages = _batch(0)
        sharded_update(model, optimizer, ids, attention, loss_mask, advantages=advantages)
        after = {k: v for piece in full_state_layers(model) for k, v in piece.items()}
    finally:
        dist.destroy_process_group()
    _assert_weights(before, kept)
    assert not torch.equal(after["model.norm.weight"], kept["model.norm.weight"])


@pytest.mark.slow  # (two gloo processes importing torch and transformers: 13-54 s for the group)
def test_a_new_checkpoint_replaces_the_old_one_whole(two_ranks):
    from ctxrl.distributed.sharded_checkpoint import checkpoint_info, load_sharded

    tmp, ranks = two_ranks
    assert checkpoint_info(tmp / "out.replaced")["step"] == CHECKPOINT_AFTER
    assert not (tmp / "out.replaced.tmp").exists() and not (tmp / "out.replaced.old").exists()
    model = _model(seed=2)
    load_sharded(tmp / "out.replaced", model)  # the weights alone
    _assert_weights(_flat(model.state_dict()), ranks[0]["after_3"])


def test_a_checkpoint_without_optimiser_state_refuses_to_restore_one(tmp_path):
    from ctxrl.distributed.sharded_checkpoint import checkpoint_info, load_sharded, save_sharded

    save_sharded(tmp_path / "weights", _model(), step=7)  # one process, no group: a plain model's checkpoint
    assert checkpoint_info(tmp_path / "weights") == {"step": 7, "world_size": 1, "optimizer": False}
    model = _model(seed=1)
    with pytest.raises(ValueError, match="holds no optimiser state.*optimizer=None"):
        load_sharded(tmp_path / "weights", model, _adamw(model))
    load_sharded(tmp_path / "weights", model)
    _assert_weights(_flat(model.state_dict()), _flat(_model().state_dict()))


def test_bad_inputs_say_what_is_wrong(tmp_path):
    from ctxrl.distributed.sharded import masked_token_loss, shard_model, sharded_optimizer, sharded_update
    from ctxrl.distributed.sharded_checkpoint import load_sharded

    model = _model()
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        shard_model(model)
    with pytest.raises(ValueError, match="shard_model has wrapped"):
        sharded_optimizer(model, lr=LR)
    with pytest.raises(ValueError, match="no trained token"):
        masked_token_loss(torch.zeros(1, 3), torch.zeros(1, 3), 0)
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"want \[B, T\], \[B, T\], \[B, T-1\]"):
        sharded_update(model, None, ids, torch.ones_like(ids), torch.ones(2, 5))
    (tmp_path / "half.tmp").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete sharded checkpoint"):
        load_sharded(tmp_path / "half.tmp", model)


# -- the per-rank memory plan: figures derived by hand -------------------------------------------------------------

def _plan(**overrides):
    args = dict(parameters=1000, dtype_bytes=2, world_size=2, device_bytes=20_000, largest_unit_parameters=100,
                headroom_fraction=0.0)
    return plan_sharded_memory(**{**args, **overrides})


def test_memory_plan_counts_shards_gathered_units_and_activations():
    plan = _plan(activation_bytes=300)
    assert plan.sharded_state_bytes == 500 * (4 + 4 + 8)  # float32 master + float32 gradient + AdamW's 2 moments
    assert plan.gathered_bytes == 2 * 100 * (2 + 4)  # two units: bf16 weights + float32 gradients
    assert plan.per_rank_bytes == 8000 + 1200 + 300 and plan.fits
    assert _plan(world_size=3).sharded_state_bytes == 334 * 16  # ceil(1000 / 3) parameters on a rank
    assert _plan(optimizer_state_bytes=0).sharded_state_bytes == 500 * 8
    assert _plan(device_bytes=100_000, headroom_fraction=0.1).budget_bytes == 90_000


def test_memory_plan_refuses_and_names_the_ranks_that_would_fit():
    with pytest.raises(ShardedMemoryError, match="shard over at least 2 ranks") as error:
        _plan(world_size=1, device_bytes=10_000)  # 16,000 + 1,200 > 10,000; the room 8,800 holds 550 a rank
    assert "LoRA" in str(error.value) and "smaller model" in str(error.value)
    # 10% headroom: a budget of 9,000; 2 ranks need 9,200; the room 7,800 holds 487 a rank -> 3 ranks
    with pytest.raises(ShardedMemoryError, match="over by .* shard over at least 3 ranks"):
        _plan(device_bytes=10_000, headroom_fraction=0.1)
    assert _plan(world_size=3, device_bytes=10_000, headroom_fraction=0.1).fits


def test_memory_plan_refuses_what_no_world_size_fits():
    # two gathered units (1,200) and the activations (0) alone exceed a 1,000-byte card
    with pytest.raises(ShardedMemoryError, match="does not fit at any world size.*LoRA"):
        _plan(device_bytes=1000, world_size=64)


def test_memory_plan_of_the_7b_shape_asks_for_two_h100s():
    """Qwen2.5-7B (7,615,616,512 parameters; its root unit, untied embeddings and head and the final norm,
    1,089,998,336) on an
    80 GiB card: 113.5 GiB of sharded state alone on one rank; on two, 56.7 + 12.2 GiB of a 72 GiB budget."""
    from transformers import Qwen2Config

    from ctxrl.distributed.sharded_memory import unit_sizes
    from ctxrl.models.shapes import SHAPES

    parameters, unit = unit_sizes(Qwen2Config(**SHAPES["qwen2.5-7b"]))
    assert (parameters, unit) == (7_615_616_512, 2 * 152064 * 3584 + 3584)  # embeddings, head, final norm
    args = dict(dtype_bytes=2, device_bytes=80 * GIB, largest_unit_parameters=unit)
    refusal = r"7,615,616,512 parameters over 1 ranks: per rank 113\.5 GiB sharded state.*at least 2 ranks"
    with pytest.raises(ShardedMemoryError, match=refusal):
        plan_sharded_memory(parameters, world_size=1, **args)
    plan = plan_sharded_memory(parameters, world_size=2, **args)
    assert plan.sharded_state_bytes == 3_807_808_256 * 16 and plan.gathered_bytes == 2 * unit * 6


@pytest.mark.parametrize("bad, message", [
    (dict(world_size=0), "world_size must be a positive integer"),
    (dict(parameters=2.5), "parameters must be a positive integer"),
    (dict(dtype_bytes=3), "dtype_bytes must be 1, 2, 4 or 8"),
    (dict(largest_unit_parameters=2000), "exceeds the model's parameters"),
    (dict(headroom_fraction=1.0), r"headroom_fraction must be in \[0, 1\)"),
    (dict(activation_bytes=-1), "cannot be negative"),
])
def test_memory_plan_bad_inputs(bad, message):
    with pytest.raises(ValueError, match=message):
        _plan(**bad)
