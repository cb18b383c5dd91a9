"""The fast engine's joined products and its rotary-and-write kernel (``engine.fast.joined``, ``engine.fast.kv_write``).

What must hold: the joined product's columns are the three (two) modules' products; the modules' parameters are
views of the joined tensors, so an in-place copy (``load_weights``) reaches them; modules that cannot be joined
are left as they were; the engine with and without the joined layout samples the same ids; the Triton kernel
(interpreter mode, where Triton is installed) writes what the unfused steps write.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ctxrl.engine.base import SamplingParams
from ctxrl.engine.fast import FastEngine
from ctxrl.engine.fast.joined import join, join_layer
from ctxrl.engine.fast.kv_write import reference
from ctxrl.models.fused import Fused, rotate, silu_mul, silu_mul_joined


def _linear(i: int, o: int, bias: bool, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(i, o, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
def test_joined_product_is_the_modules_products_and_their_parameters_are_views(bias):
    q, k, v = _linear(16, 12, bias, 0), _linear(16, 4, bias, 1), _linear(16, 4, bias, 2)
    h = torch.randn(5, 16)
    want = [m(h) for m in (q, k, v)]
    ids = [id(m.weight) for m in (q, k, v)]
    joined = join([q, k, v])
    assert joined.widths == (12, 4, 4) and joined.weight.shape == (20, 16)
    assert [id(m.weight) for m in (q, k, v)] == ids  # the same Parameter objects (an optimiser's references hold)
    got = torch.nn.functional.linear(h, joined.weight, joined.bias).split(joined.widths, dim=-1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    for g, m in zip(got, (q, k, v)):  # each module still computes its own product, from the joined storage
        torch.testing.assert_close(m(h), g, atol=1e-6, rtol=0)
    assert k.weight.data_ptr() == joined.weight[12].data_ptr()
    with torch.no_grad():  # load_weights copies in place: the joined tensor sees it
        k.weight.copy_(torch.full_like(k.weight, 0.5))
        if bias:
            v.bias.copy_(torch.full_like(v.bias, -2.0))
    assert torch.equal(joined.weight[12:16], torch.full((4, 16), 0.5))
    if bias:
        assert torch.equal(joined.bias[16:], torch.full((4,), -2.0))
    else:
        assert joined.bias is None


def test_modules_that_cannot_be_joined_are_left_alone():
    a, b = _linear(8, 4, True, 0), _linear(8, 4, False, 1)
    before = (a.weight.data_ptr(), b.weight.data_ptr())
    assert join([a, b]) is None  # a bias on one only
    assert join([a, _linear(6, 4, True, 2)]) is None  # other input width
    assert join([a, copy.deepcopy(a).to(torch.float64)]) is None  # other dtype

    class Wrapped(torch.nn.Linear):  # e.g. an adapter-wrapped projection: its forward is not F.linear alone
        pass

    assert join([a, Wrapped(8, 4)]) is None
    assert (a.weight.data_ptr(), b.weight.data_ptr()) == before


def test_a_layer_joins_qkv_and_gate_up_and_silu_of_the_halves_is_silu_mul():
    from ctxrl.models.shapes import random_model

    model = random_model("qwen2-test", torch.float32, "cpu").eval()
    layer = model.model.layers[0]
    h = torch.randn(3, model.config.hidden_size)
    gate, up = layer.mlp.gate_proj(h), layer.mlp.up_proj(h)
    joined = join_layer(layer)
    assert joined.qkv is not None and joined.gate_up is not None
    product = torch.nn.functional.linear(h, joined.gate_up.weight, joined.gate_up.bias)
    torch.testing.assert_close(silu_mul_joined(product), silu_mul(gate, up), atol=1e-6, rtol=0)


def _complete(engine, prompts, params):
    async def go():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return asyncio.run(go())


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_engine_samples_the_same_with_and_without_the_joined_layout(family):
    from ctxrl.models.shapes import random_model

    if family == "qwen2":
        model = random_model("qwen2-test", torch.float32, "cpu").eval()  # q/k/v with biases
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                             max_position_embeddings=512, pad_token_id=0, bos_token_id=None,
                                             eos_token_id=1)).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 290, (n,), generator=g).tolist() for n in (5, 17, 40)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=11)
    out = {}
    for fuse in (True, False):
        engine = FastEngine(copy.deepcopy(model), pad_token_id=0, max_batch_size=4, max_total_tokens=128, fuse=fuse)
        try:
            assert all(j.qkv is not None and j.gate_up is not None for j in engine.view.joined) == fuse
            out[fuse] = _complete(engine, prompts, params)
        finally:
            engine.close()
    for a, b in zip(out[True], out[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_reference_write_rotates_q_and_k_and_writes_k_and_v_at_each_slot_and_position():
    torch.manual_seed(0)
    tokens, q_heads, kv_heads, dim, slots, capacity = 4, 4, 2, 8, 3, 10
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(tokens, 1, dim), torch.randn(tokens, 1, dim)
    where_slot, where_pos = torch.tensor([2, 0, 2, 1]), torch.tensor([0, 5, 1, 9])
    ck, cv = torch.zeros(slots, kv_heads, capacity, dim), torch.zeros(slots, kv_heads, capacity, dim)
    q = reference(Fused(False), qkv, cos, sin, where_slot, where_pos, ck, cv, q_heads, kv_heads, dim)
    qs, ks, vs = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    torch.testing.assert_close(q, rotate(qs.view(tokens, q_heads, dim), cos, sin))
    for t in range(tokens):
        s, p = int(where_slot[t]), int(where_pos[t])
        half = dim // 2
        k = ks[t].view(kv_heads, dim)
        by_hand = torch.cat([k[:, :half] * cos[t, 0, :half] - k[:, half:] * sin[t, 0, :half],
                             k[:, half:] * cos[t, 0, half:] + k[:, :half] * sin[t, 0, half:]], dim=-1)
        torch.testing.assert_close(ck[s, :, p], by_hand)
        torch.testing.assert_close(cv[s, :, p], vs[t].view(kv_heads, dim))
    written = {(int(s), int(p)) for s, p in zip(where_slot, where_pos)}
    for s in range(slots):
        for p in range(capacity):
            if (s, p) not in written:
                assert not ck[s, :, p].any() and not cv[s, :, p].any()


KERNEL_SCRIPT = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from ctxrl.engine.fast import kv_write as W
    from ctxrl.models.fused import Fused
    assert W.triton is not None
    torch.manual_seed(0)
    worst = 0.0
    for tokens, q_heads, kv_heads, dim, slots, capacity in [(5, 4, 2, 16, 3, 12), (3, 7, 1, 32, 4, 9)]:
        qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim)
        table_cos, table_sin = torch.randn(capacity, dim), torch.randn(capacity, dim)
        positions = torch.randint(0, capacity, (tokens,))
        where_slot = torch.randperm(slots)[:tokens] if tokens <= slots else torch.randint(0, slots, (tokens,))
        where_pos = positions.clamp(max=capacity - 2)
        ref_k, ref_v = torch.randn(slots, kv_heads, capacity, dim), torch.randn(slots, kv_heads, capacity, dim)
        got_k, got_v = ref_k.clone(), ref_v.clone()
        cos, sin = table_cos[positions].unsqueeze(1), table_sin[positions].unsqueeze(1)
        want = W.reference(Fused(False), qkv, cos, sin, where_slot, where_pos, ref_k, ref_v, q_heads, kv_heads, dim)
        got = W.rope_write(qkv, table_cos, table_sin, positions, where_slot, where_pos, got_k, got_v,
                           q_heads, kv_heads, dim)
        for a, b in ((got, want), (got_k, ref_k), (got_v, ref_v)):
            worst = max(worst, float((a - b).abs().max()))
    print("MAXERR", worst)

    # the whole engine with the kernel (forced on: the interpreter runs it on the CPU) against the unfused steps
    import asyncio, copy
    from ctxrl.engine.base import SamplingParams
    from ctxrl.engine.fast import FastEngine
    from ctxrl.models.shapes import random_model
    W.kernel_ready = lambda qkv, head_dim: True
    model = random_model("qwen2-test", torch.float32, "cpu").eval()
    prompts = [list(range(3, 3 + n)) for n in (4, 9)]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=5)
    runs = {}
    for fuse in (True, False):
        engine = FastEngine(copy.deepcopy(model), pad_token_id=0, max_batch_size=2, max_total_tokens=32, fuse=fuse,
                            decode_chunk=2)
        assert engine.view.kernel_write == fuse
        async def go():
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        runs[fuse] = asyncio.run(go())
        engine.close()
    same = all(a.token_ids == b.token_ids for a, b in zip(runs[True], runs[False]))
    gap = max(abs(x - y) for a, b in zip(runs[True], runs[False]) for x, y in zip(a.logprobs, b.logprobs))
    print("ENGINE", same, gap)
""")


def test_rope_write_kernel_in_interpreter_mode_matches_the_unfused_steps():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.split("MAXERR")[-1].split()[0]) < 1e-5
    same, gap = result.stdout.split("ENGINE")[-1].split()
    assert same == "True" and float(gap) < 1e-5
