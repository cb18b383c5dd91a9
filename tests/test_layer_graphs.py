"""The learner's layers as CUDA graphs (``ctxrl.learner.layer_graphs``): the bucket a micro-batch is laid into, its
padding, and the whole graphed path through ``FlatDecoder``, on the CPU with a capture that returns the layers
as they are (the real capture, ``torch.cuda.make_graphed_callables``, is run and timed on a GPU by
``benchmarks/grpo_step.py --learner-arms``). Float64, one SDPA call per sequence: the padded path must equal the
unpadded one in hidden states and in every gradient."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from ctxrl.errors import ConfigError
from ctxrl.learner.flat import FlatDecoder, training_decoder
from ctxrl.learner.layer_graphs import Bucket, LayerGraphs, pad
from ctxrl.models.shapes import random_model
from ctxrl.train.batch import collate, pack
from ctxrl.train.learner import Learner, PPOSettings
from ctxrl.train.packing import flatten
from ctxrl.train.precision import MasterAdamW, Precision


def test_a_bucket_rounds_tokens_up_and_the_longest_and_sequence_count_to_powers_of_two():
    b = Bucket.covering(5000, 10, 300)
    assert b == Bucket(tokens=5120, sequences=64, longest=512)
    assert b.padding_sequences(5000) == 1 and b.holds(5000, 10, 300)
    # the learner's budget sets the floor, so every micro-batch of a run fits the first capture
    assert Bucket.covering(5000, 10, 300, min_tokens=8192).tokens == 8192
    # a micro-batch the bucket holds keeps it; one it does not grows it, never shrinking another dimension
    assert Bucket.covering(4000, 60, 500, current=b) is b
    grown = Bucket.covering(6000, 10, 100, current=b)
    assert grown == Bucket(tokens=6144, sequences=64, longest=512)
    many = Bucket.covering(5000, 70, 300, current=b)
    assert many.sequences == 128 and many.tokens == 5120 and many.longest == 512
    # the padding is cut into sequences no longer than the kernel's longest, and they count
    short = Bucket.covering(1024, 1, 16)
    assert short.padding_sequences(24) == 63 and short.sequences == 64 and short.holds(24, 1, 16)
    assert not short.holds(15, 1, 16)  # 64 padding sequences and the real one: 65 > 64


@pytest.mark.parametrize("lengths,bucket", [([7, 2, 12], Bucket(64, 8, 16)), ([16, 16], Bucket(32, 4, 16)),
                                            ([5], Bucket(40, 8, 8))])
def test_padding_keeps_the_real_tokens_and_cuts_the_rest_into_short_sequences_then_empty_ones(lengths, bucket):
    ids = torch.arange(1, sum(lengths) + 1)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n = sum(lengths)
    p_ids, p_pos, p_cu = pad(ids, positions, cu, bucket)
    assert p_ids.shape == p_pos.shape == (bucket.tokens,) and p_cu.shape == (bucket.sequences + 1,)
    assert torch.equal(p_ids[:n], ids) and torch.equal(p_pos[:n], positions) and (p_ids[n:] == 0).all()
    assert torch.equal(p_cu[: len(cu)], cu) and p_cu.dtype == cu.dtype and int(p_cu[-1]) == bucket.tokens
    sizes = (p_cu[1:] - p_cu[:-1]).tolist()
    real, rest = sizes[: len(lengths)], sizes[len(lengths):]
    assert real == lengths and all(0 <= s <= bucket.longest for s in rest) and sum(rest) == bucket.tokens - n
    assert rest == sorted(rest, reverse=True)  # the padding's sequences, then only empty ones
    for start, end in zip(p_cu[len(lengths):-1].tolist(), p_cu[len(lengths) + 1:].tolist()):
        assert p_pos[start:end].tolist() == list(range(end - start))  # positions restart in each


def test_padding_refuses_a_micro_batch_its_bucket_cannot_hold():
    ids, positions = torch.arange(10), torch.arange(10)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit"):
        pad(ids, positions, cu, Bucket(8, 4, 16))


def _eager_capture(calls):
    def capture(modules, samples):
        calls.append(samples[0][0].shape[0])
        return modules  # (the layers as they are: what a faithful capture replays)
    return capture


def _buffered_capture(calls=None):
    """A capture that behaves as ``make_graphed_callables``' replays do where it matters to correctness: each layer's
    weight gradients come back in buffers of its own that the next backward overwrites (``b.detach()`` of a static
    gradient), and the forward runs without building an autograd graph of its own."""
    def capture(modules, samples):
        if calls is not None:
            calls.append(samples[0][0].shape[0])
        replays = []
        for module in modules:
            params = tuple(module.parameters())
            buffers = [torch.zeros_like(p) for p in params]

            class Replay(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, cos, sin, cu, *ps, module=module):
                    ctx.save_for_backward(x, cos, sin, cu)
                    return module(x, cos, sin, cu)

                @staticmethod
                def backward(ctx, grad, module=module, params=params, buffers=buffers):
                    x, cos, sin, cu = ctx.saved_tensors
                    with torch.enable_grad():
                        v = x.detach().requires_grad_(True)
                        found = torch.autograd.grad(module(v, cos, sin, cu), (v, *params), grad)
                    for buffer, g in zip(buffers, found[1:]):
                        buffer.copy_(g)
                    return (found[0], None, None, None, *(b.detach() for b in buffers))

            replays.append(lambda x, cos, sin, cu, replay=Replay, params=params: replay.apply(x, cos, sin, cu,
                                                                                               *params))
        return tuple(replays)
    return capture


def _hidden_and_grads(model, flat, graphed, capture=None):
    m = copy.deepcopy(model).train()
    decoder = FlatDecoder(m)
    if graphed:
        decoder.graphs = LayerGraphs(decoder.layers, decoder._block, capture=capture)
    hidden = decoder.hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest)
    (hidden * torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).view_as(hidden)).sum().backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, decoder


@pytest.mark.parametrize("family", ["qwen2-test"])
def test_the_graphed_path_equals_the_eager_one_in_hidden_states_and_every_gradient(family):
    model = random_model(family, torch.float64, "cpu", seed=0)
    lengths = [9, 4, 13, 6]
    ids = torch.randint(3, model.config.vocab_size, (len(lengths), max(lengths)), generator=torch.Generator()
                        .manual_seed(1)) * (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1))
    flat = flatten(ids, torch.tensor(lengths))
    calls: list[int] = []
    want, want_grads, _ = _hidden_and_grads(model, flat, graphed=False)
    got, got_grads, decoder = _hidden_and_grads(model, flat, graphed=True, capture=_eager_capture(calls))
    assert calls == [1024] and decoder.graphs.captures == 1 and decoder.graphs.bucket.tokens == 1024
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 0
    for name in want_grads:  # padding rows add exactly nothing to any weight's gradient
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-10, rtol=1e-9, msg=name)
    # a second micro-batch that fits the bucket replays the same capture
    decoder.hidden_states(flat.ids[:20], flat.positions[:20], torch.tensor([0, 9, 13, 20], dtype=torch.int32), 13)
    assert calls == [1024] and decoder.graphs.captures == 1


def test_a_capture_that_does_not_reproduce_the_layers_falls_back_to_the_eager_layers(caplog):
    model = random_model("qwen2-test", torch.float64, "cpu", seed=0)
    lengths = [9, 4]
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    flat = flatten(ids, torch.tensor(lengths))

    def wrong(modules, samples):
        return tuple(lambda x, cos, sin, cu: x * 2 for _ in modules)

    def broken(modules, samples):
        raise RuntimeError("operation not permitted when stream is capturing")

    want, want_grads, _ = _hidden_and_grads(model, flat, graphed=False)
    for capture, says in ((wrong, "did not reproduce"), (broken, "not permitted")):
        with caplog.at_level(logging.WARNING, logger="ctxrl.learner.flat"):
            got, got_grads, decoder = _hidden_and_grads(model, flat, graphed=True, capture=capture)
        assert decoder.graphs is None and says in caplog.text and "eagerly" in caplog.text
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-10, rtol=1e-9)
        caplog.clear()


def test_without_a_gradient_under_checkpointing_or_with_length_dependent_rotary_the_layers_run_eagerly():
    model = random_model("qwen2-test", torch.float64, "cpu", seed=0).train()
    flat = flatten(torch.tensor([[5, 6, 7]]), torch.tensor([3]))
    decoder = FlatDecoder(model)
    calls: list[int] = []
    decoder.graphs = LayerGraphs(decoder.layers, decoder._block, capture=_eager_capture(calls))
    with torch.no_grad():
        decoder.hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest)
    decoder.exact_rotary = True  # (longrope: rotary tables that depend on the length asked for)
    decoder.hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest).sum().backward()
    decoder.exact_rotary = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    decoder.hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest).sum().backward()
    assert calls == []


def test_graphed_mode_is_refused_off_cuda_with_the_fix():
    model = random_model("qwen2-test", torch.float64, "cpu", seed=0)
    with pytest.raises(ConfigError, match="torch.float64 on cpu: set train.flat_forward=on"):
        training_decoder(model, "graphed")


def test_the_learner_sets_the_bucket_floor_to_its_token_budget(monkeypatch):
    model = random_model("qwen2-test", torch.float64, "cpu", seed=0)
    decoder = FlatDecoder(model)
    decoder.graphs = LayerGraphs(decoder.layers, decoder._block)
    monkeypatch.setattr("ctxrl.learner.forward.training_decoder", lambda m, mode: decoder)
    Learner(model, torch.optim.SGD(model.parameters(), lr=0.1),
            PPOSettings(flat_forward="on", max_tokens_per_microbatch=4096), pad_token_id=0)
    assert decoder.graphs.min_tokens == 4096


def test_flat_micro_batches_count_their_own_tokens_not_their_padding():
    lengths = [100, 10, 10, 10, 10, 90]
    # padded: rows x the longest row (100 x 2 > 150): one row a micro-batch until the short ones
    assert pack(lengths, 64, 150) == [[0], [5], [1, 2, 3, 4]]
    # flat: the tokens themselves, longest first (90 + 4 x 10 = 130 <= 150)
    assert pack(lengths, 64, 150, padded=False) == [[0], [5, 1, 2, 3, 4]]
    assert pack(lengths, 3, 150, padded=False) == [[0], [5, 1, 2], [3, 4]]  # (and never more rows than asked)
    # one long row leading many short ones: rows x the longest stay within PADDED_BOUND x the budget (4 x 100)
    assert pack([100] + [1] * 20, 64, 100, padded=False) == [[0], list(range(1, 21))]
    assert pack([40] + [1] * 20, 64, 100, padded=False) == [[0, *range(1, 10)], list(range(10, 21))]


def test_a_learner_update_on_the_graphed_path_equals_the_eager_update(scored_episodes, monkeypatch):
    model = random_model("qwen2-test", torch.float64, "cpu", seed=0)
    batch = collate(scored_episodes(model.config.vocab_size, [12, 5, 8, 3, 10], seed=2), 0,
                    advantages=[1.0, -1.0, 0.5, -0.5, 0.25])
    out = []
    for graphed in (False, True):
        m = copy.deepcopy(model)
        decoder = FlatDecoder(m)
        calls: list[int] = []
        if graphed:  # (replays whose weight gradients come back in buffers the next one overwrites)
            decoder.graphs = LayerGraphs(decoder.layers, decoder._block, capture=_buffered_capture(calls))
        monkeypatch.setattr("ctxrl.learner.forward.training_decoder", lambda model, mode, d=decoder: d)
        # (one mini-batch of four micro-batches by their tokens: 12 | 10 | 8 + 5 | 3, whose gradients must add up)
        settings = PPOSettings(flat_forward="on", logprob_chunk_tokens=4, micro_batch_size=2, mini_batches=1,
                               max_tokens_per_microbatch=13)
        learner = Learner(m, torch.optim.SGD(m.parameters(), lr=0.1), settings, pad_token_id=0, seed=3)
        metrics = learner.update(batch)
        assert learner.micro_batches_run == 4
        out.append((metrics, torch.cat([p.detach().flatten() for p in m.parameters()])))
        if graphed:
            assert calls == [1024] and decoder.graphs.captures == 1  # (the budget, rounded up to a bucket step)
    (m_a, w_a), (m_b, w_b) = out
    torch.testing.assert_close(w_a, w_b, atol=1e-10, rtol=1e-9)
    for key in ("loss", "entropy", "grad_norm"):
        assert m_a[key] == pytest.approx(m_b[key], rel=1e-7, abs=1e-12), key


def test_under_float32_masters_a_graphed_update_needs_no_gradient_copies_and_equals_the_eager_one(
        scored_episodes, monkeypatch):
    # the masters' hooks add each gradient into a float32 one and free it before the next replay overwrites its
    # buffer: the learner turns the copies off, and four micro-batches still add up to the eager update
    model = random_model("qwen2-test", torch.bfloat16, "cpu", seed=0)
    batch = collate(scored_episodes(model.config.vocab_size, [12, 5, 8, 3, 10], seed=2), 0,
                    advantages=[1.0, -1.0, 0.5, -0.5, 0.25])
    precision = Precision("bfloat16", "float32", "cpu")
    out = []
    for graphed in (False, True):
        m = copy.deepcopy(model)
        decoder = FlatDecoder(m)
        if graphed:
            decoder.graphs = LayerGraphs(decoder.layers, decoder._block, capture=_buffered_capture())
        monkeypatch.setattr("ctxrl.learner.forward.training_decoder", lambda model, mode, d=decoder: d)
        settings = PPOSettings(flat_forward="on", logprob_chunk_tokens=4, micro_batch_size=2, mini_batches=1,
                               max_tokens_per_microbatch=13)
        optimizer = precision.optimizer(m.parameters(), lr=1e-3)
        assert isinstance(optimizer, MasterAdamW)
        learner = Learner(m, optimizer, settings, pad_token_id=0, seed=3, precision=precision)
        metrics = learner.update(batch)
        assert learner.micro_batches_run == 4
        if graphed:
            assert decoder.graphs.copy_grads is False and decoder.graphs._hooks == []
        out.append((metrics, torch.cat([p.detach().flatten() for p in optimizer.masters])))
    (m_a, w_a), (m_b, w_b) = out
    torch.testing.assert_close(w_a, w_b, atol=0, rtol=0)
    assert m_a["grad_norm"] == m_b["grad_norm"]


def test_a_plain_optimiser_after_a_master_one_gets_the_gradient_copies_back():
    model = random_model("qwen2-test", torch.float64, "cpu", seed=0)
    decoder = FlatDecoder(model)
    graphs = decoder.graphs = LayerGraphs(decoder.layers, decoder._block, capture=_buffered_capture())
    graphs.copy_grads = False
    flat = flatten(torch.randint(3, 50, (2, 6)), torch.tensor([6, 4]))
    decoder.hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest).sum().backward()
    assert graphs.captures == 1 and graphs._hooks == []
    graphs.copy_grads = True  # (a later learner with a plain optimiser, after the capture)
    trained = [p for layer in decoder.layers for p in layer.parameters() if p.requires_grad]
    assert len(graphs._hooks) == len(trained) > 0


def test_auto_graphs_only_models_narrow_enough_to_be_launch_bound():
    from transformers import LlamaConfig, Phi3Config

    from ctxrl.learner.flat import AUTO_GRAPHED_MAX_HIDDEN, auto_graphs

    for width in (576, 896, AUTO_GRAPHED_MAX_HIDDEN):
        assert auto_graphs(LlamaConfig(hidden_size=width))
    assert not auto_graphs(LlamaConfig(hidden_size=1536)) and not auto_graphs(None)
    longrope = Phi3Config(hidden_size=512, num_attention_heads=8, max_position_embeddings=8192,
                          original_max_position_embeddings=4096,
                          rope_scaling={"type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32})
    assert not auto_graphs(longrope)


def test_a_bucket_that_grows_is_captured_again_and_the_old_graphs_let_go():
    model = random_model("qwen2-test", torch.float64, "cpu", seed=0).train()
    decoder = FlatDecoder(model)
    calls: list[int] = []
    decoder.graphs = graphs = LayerGraphs(decoder.layers, decoder._block, capture=_buffered_capture(calls))
    short = flatten(torch.tensor([[5, 6, 7]]), torch.tensor([3]))
    decoder.hidden_states(short.ids, short.positions, short.cu_seqlens, short.longest).sum().backward()
    first = graphs.bucket
    hooks = len(graphs._hooks)
    assert first.longest == 4 and hooks == sum(1 for layer in decoder.layers for _ in layer.parameters())
    # a longer row: the bucket grows in its longest only, and the gradients hooks are not doubled
    ids = torch.arange(3, 40).unsqueeze(0)
    longer = flatten(ids, torch.tensor([37]))
    want, want_grads, _ = _hidden_and_grads(model, longer, graphed=False)
    model.zero_grad(set_to_none=True)
    got = decoder.hidden_states(longer.ids, longer.positions, longer.cu_seqlens, longer.longest)
    (got * torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)).sum().backward()
    assert graphs.captures == 2 and graphs.bucket.longest == 64 and graphs.bucket.tokens == first.tokens
    assert len(graphs._hooks) == hooks
    torch.testing.assert_close(got.detach(), want, atol=1e-10, rtol=1e-9)
    for name, p in model.named_parameters():
        if name in want_grads:
            torch.testing.assert_close(p.grad, want_grads[name], atol=1e-10, rtol=1e-9, msg=name)
    graphs.release()
    assert graphs.bucket is None and graphs._hooks == []


def test_layers_with_module_hooks_are_not_graphed(caplog):
    model = random_model("qwen2-test", torch.float64, "cpu", seed=0).train()
    decoder = FlatDecoder(model)
    decoder.graphs = LayerGraphs(decoder.layers, decoder._block, capture=_buffered_capture())
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: None)
    flat = flatten(torch.tensor([[5, 6, 7]]), torch.tensor([3]))
    with caplog.at_level(logging.WARNING, logger="ctxrl.learner.flat"):
        decoder.hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest).sum().backward()
    assert decoder.graphs is None and "module hooks" in caplog.text and "mlp" in caplog.text


def test_gradient_copies_stay_unless_live_masters_take_every_layer_parameter(monkeypatch):
    def copies(make_optimizer):
        model = random_model("qwen2-test", torch.bfloat16, "cpu", seed=0)
        decoder = FlatDecoder(model)
        decoder.graphs = LayerGraphs(decoder.layers, decoder._block)
        monkeypatch.setattr("ctxrl.learner.forward.training_decoder", lambda m, mode: decoder)
        Learner(model, make_optimizer(model), PPOSettings(flat_forward="on"), pad_token_id=0)
        return decoder.graphs.copy_grads

    precision = Precision("bfloat16", "float32", "cpu")
    assert copies(lambda m: precision.optimizer(m.parameters(), lr=1e-3)) is False
    # masters over only some of the layers' parameters: the others' gradients would alias the graphs' buffers
    assert copies(lambda m: precision.optimizer(list(m.parameters())[:3], lr=1e-3)) is True

    def closed(m):
        optimizer = precision.optimizer(m.parameters(), lr=1e-3)
        optimizer.close()
        return optimizer
    assert copies(closed) is True
    assert copies(lambda m: torch.optim.SGD(m.parameters(), lr=0.1)) is True
