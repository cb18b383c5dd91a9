"""FastEngine: slot bookkeeping, parity with HFEngine (ids, log-probs, finish reasons) on several model
families, prefix reuse, continuous batching, stops, weight updates, cancellation and errors.

Everything runs on the CPU, where the fast engine runs its logic eagerly (no CUDA graphs, no Triton).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib.util
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from ctxrl.engine.base import Completion, SamplingParams
from ctxrl.engine.fast import FastEngine, UnsupportedModel
from ctxrl.engine.fast.attention import decode_attention, reference_attention
from ctxrl.engine.fast.slots import BLOCK, Placement, SlotTable, block_hashes
from ctxrl.engine.hf import HFEngine
from ctxrl.engine.sampling import filter_logits

MAX_TOTAL = 256


# -- tiny models -----------------------------------------------------------------------------------

def _build(config_cls, model_cls, seed: int, **kw):
    torch.manual_seed(seed)
    config = config_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=300, max_position_embeddings=512, pad_token_id=0, bos_token_id=None,
                        eos_token_id=1, **kw)
    return model_cls(config).eval()


@functools.cache
def _model(family: str, seed: int = 0):
    """A tiny random float32 model of ``family`` (built once per process; engines get deep copies)."""
    if family == "qwen2":
        from ctxrl.models.shapes import random_model

        return random_model("qwen2-test", torch.float32, "cpu", seed=seed).eval()
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return _build(LlamaConfig, LlamaForCausalLM, seed, num_key_value_heads=2)
    if family == "llama-mqa":
        from transformers import LlamaConfig, LlamaForCausalLM

        return _build(LlamaConfig, LlamaForCausalLM, seed, num_key_value_heads=1, tie_word_embeddings=True)
    if family == "qwen3":
        transformers = pytest.importorskip("transformers")
        if not hasattr(transformers, "Qwen3Config"):
            pytest.skip("this transformers has no Qwen3")
        return _build(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, seed, num_key_value_heads=2,
                      head_dim=16)
    raise ValueError(family)


def _vocab(model) -> int:
    return model.config.vocab_size


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def fast():
    """``fast(model, **kw)``: a FastEngine over a deep copy of ``model``, closed at teardown."""
    made: list[FastEngine] = []

    def make(model, **kw) -> FastEngine:
        kw.setdefault("max_total_tokens", MAX_TOTAL)
        kw.setdefault("pad_token_id", 0)
        engine = FastEngine(copy.deepcopy(model), **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def _hf(model, **kw) -> HFEngine:
    kw.setdefault("max_total_tokens", MAX_TOTAL)
    kw.setdefault("pad_token_id", 0)
    return HFEngine(copy.deepcopy(model), **kw)


def _run(engine, prompts, params) -> list[Completion]:
    """All requests at once; ``params`` is one SamplingParams or one per prompt."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)

    async def go():
        return await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params)))
    return list(asyncio.run(go()))


def _assert_same(got: list[Completion], want: list[Completion], atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.token_ids == b.token_ids, f"request {i}: ids differ"
        assert a.finish_reason == b.finish_reason, f"request {i}"
        assert len(a.logprobs) == len(a.token_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs, dtype=torch.float64),
                                   torch.tensor(b.logprobs, dtype=torch.float64), atol=atol, rtol=0,
                                   msg=f"request {i}: log-probs differ")


# -- 1. SlotTable ------------------------------------------------------------------------------------

def _ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_slot_table_places_in_the_lowest_free_slot_and_take_and_release():
    t = SlotTable(4)
    claimed: dict = {}
    assert t.place([1, 2, 3], claimed) == Placement(0)
    assert t.place([4, 5], claimed) == Placement(1)
    assert t.take() == Placement(2)
    assert t.active == {0, 1, 2} and t.high == 3
    t.release(1)
    assert t.active == {0, 2} and t.high == 3 and 1 in t.free
    assert t.place([7], {}) == Placement(1)  # the lowest free slot again
    t.release(2)
    assert t.high == 2
    t.release(0), t.release(1)
    assert t.high == 0 and sorted(t.free) == [0, 1, 2, 3] and not t.active
    with pytest.raises(ValueError):
        SlotTable(0)


def _waiting(*prompts: list[int], cancelled: tuple[int, ...] = ()):
    """Requests as the engine queues them, one per prompt (``cancelled``: the indices whose callers gave up)."""
    from ctxrl.engine.fast.rows import Request

    loop = asyncio.new_event_loop()
    requests = []
    for i, prompt in enumerate(prompts):
        future = loop.create_future()
        if i in cancelled:
            future.cancel()
        requests.append(Request(list(prompt), SamplingParams(), future, loop))
    loop.close()
    return requests


def test_an_admission_round_leads_follows_and_defers_in_arrival_order():
    from ctxrl.engine.fast.admission import plan_round

    a, b, c = _ids(40), _ids(12, start=2000), _ids(5, start=3000)
    # a GRPO group of three on prompt a, then b, then c: 4 slots
    waiting = _waiting(a, a, b, a, c)
    round_ = plan_round(waiting, SlotTable(4))
    assert [(r.prompt_ids[0], p.slot) for r, p in round_.leaders] == [(1000, 0), (2000, 2)]
    assert [(r.prompt_ids[0], slot, leader) for r, slot, leader in round_.followers] == [(1000, 1, 0), (1000, 3, 0)]
    assert round_.deferred == [waiting[4]]  # no slot left for c
    assert round_.requests == [waiting[0], waiting[2], waiting[1], waiting[3]]
    assert round_.slots == [0, 2, 1, 3] and round_.logit_rows == [0, 1, 0, 0]
    assert round_.reused == 80  # two followers copy their leader's 40 prompt tokens; nothing was parked


def test_once_one_request_waits_every_later_one_waits_and_a_cancelled_one_is_dropped():
    from ctxrl.engine.fast.admission import plan_round

    table = SlotTable(2)
    assert table.place(_ids(40), {}) == Placement(0)
    table.park(0, _ids(40))  # the previous turn of a conversation, kept in slot 0
    assert table.take() == Placement(1)  # slot 1 is busy
    long_turn = _ids(40) + [7, 8]
    waiting = _waiting(_ids(3, start=5000), long_turn, _ids(4, start=6000), cancelled=(0,))
    round_ = plan_round(waiting, table)
    # the cancelled first request is dropped; the second reuses its parked prefix (40 of 42 tokens) in slot 0
    assert [(r.prompt_ids, p.slot, p.cached) for r, p in round_.leaders] == [(long_turn, 0, 40)]
    assert round_.followers == [] and round_.deferred == [waiting[2]] and round_.reused == 40
    # a request that could fit later still waits behind one that could not: first come, first served
    assert plan_round(_waiting(_ids(3), _ids(3, start=9000)), SlotTable(1)).deferred[0].prompt_ids[0] == 9000


def test_slot_table_reuses_a_parked_prefix_of_at_least_one_block():
    t = SlotTable(3)
    turn1 = _ids(40)
    p = t.place(turn1, {})
    assert p == Placement(0)
    t.park(0, turn1)
    assert t.parked == {0: tuple(turn1)} and not t.active and t.high == 0
    # the next turn extends it: everything kept is reused
    claimed: dict = {}
    p = t.place(turn1 + [1, 2, 3], claimed)
    assert p == Placement(0, cached=40)
    assert claimed == {0: tuple(turn1)} and 0 not in t.parked and t.active == {0}
    # a prompt equal to the kept ids: at most len(prompt) - 1 (the last token is always prefilled)
    t.park(0, turn1)
    assert t.place(list(turn1), {}) == Placement(0, cached=39)
    # a prompt that diverges after 20 ids reuses 20
    t.park(0, turn1)
    assert t.place(turn1[:20] + [7] * 10, {}) == Placement(0, cached=20)
    # a shared prefix shorter than one block is not reused: a free slot, nothing cached
    t.park(0, turn1)
    assert t.place(turn1[:BLOCK - 1] + [7] * 30, {}) == Placement(1)
    assert 0 in t.parked
    # exactly one block is enough
    assert t.place(turn1[:BLOCK] + [7] * 30, {}) == Placement(0, cached=BLOCK)
    # a prompt that starts differently matches nothing
    t.park(0, turn1)
    assert t.place([5] + turn1, {}) == Placement(2)


def test_slot_table_second_match_in_a_round_gets_a_free_slot_and_a_source():
    t = SlotTable(3)
    base = _ids(32)
    t.place(base, {})
    t.park(0, base)
    claimed: dict = {}
    first = t.place(base + [1], claimed)
    assert first == Placement(0, cached=32)
    second = t.place(base + [2, 3], claimed)
    assert second == Placement(1, cached=32, source=0)
    third = t.place(base[:20] + [9] * 5, claimed)  # a shorter match of the claimed slot
    assert third == Placement(2, cached=20, source=0)
    assert t.active == {0, 1, 2}
    assert t.place(base + [4], claimed) is None  # everything active: wait


def test_slot_table_evicts_the_least_recently_parked_slot():
    t = SlotTable(2)
    a, b = _ids(20, 0), _ids(20, 100)
    t.place(a, {}), t.place(b, {})
    assert t.place(_ids(5, 500), {}) is None and t.take() is None  # both active
    t.park(1, b)  # b parked first: least recently used
    t.park(0, a)
    p = t.place(_ids(20, 300), {})
    assert p == Placement(1)  # b's slot evicted
    assert t.parked == {0: tuple(a)}
    assert t.place(b + [1], {}) == Placement(0)  # b forgotten: no reuse; a's slot evicted in turn
    assert t.parked == {} and t.index == {} and t.place([1], {}) is None
    # take() evicts too, and a later use refreshes a slot's recency
    t = SlotTable(2)
    t.place(a, {}), t.place(b, {})
    t.park(0, a)
    t.park(1, b)
    assert t.place(a + [1], {}) == Placement(0, cached=20)  # a used again
    t.park(0, a + [1])
    assert t.take() == Placement(1)  # b is now the least recently used
    assert set(t.parked) == {0}


def test_slot_table_park_replaces_and_release_forgets():
    t = SlotTable(2)
    a = _ids(40)
    t.place(a, {})
    t.park(0, a)
    t.place(a + [1], {})
    t.park(0, a[:16] + [5] * 30)  # the slot now holds other ids: the old chain is gone from the index
    assert t.place(a + [2], {}) == Placement(0, cached=16)
    t.release(0)
    assert t.parked == {} and t.index == {} and t.hashes == {}
    assert t.place(a + [2], {}) == Placement(0)


def test_common_prefix_matches_brute_force():
    rng = random.Random(0)

    def brute(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for _ in range(2000):
        n = rng.randrange(0, 60)
        a = tuple(rng.randrange(3) for _ in range(n))
        if rng.random() < 0.5:
            cut = rng.randrange(0, n + 1)
            b = a[:cut] + tuple(rng.randrange(3) for _ in range(rng.randrange(0, 30)))
        else:
            b = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 60)))
        assert SlotTable.common_prefix(a, b) == brute(a, b), (a, b)
    assert SlotTable.common_prefix((), (1,)) == 0
    assert SlotTable.common_prefix((1, 2), (1, 2)) == 2


def test_block_hashes_chain():
    ids = list(range(50))
    h = block_hashes(ids)
    assert len(h) == 50 // BLOCK == 3
    assert block_hashes(ids[:15]) == []
    for j in range(len(h)):  # entry j depends on ids[:16 (j + 1)] only
        assert block_hashes(ids[:BLOCK * (j + 1)]) == h[: j + 1]
    # changing one id in block 0 changes every later entry (a chain, not per-block hashes)
    other = [99] + ids[1:]
    assert all(x != y for x, y in zip(block_hashes(other), h))
    # changing block 2 leaves blocks 0 and 1
    later = ids[:40] + [99] + ids[41:]
    assert block_hashes(later)[:2] == h[:2] and block_hashes(later)[2] != h[2]
    # the same block at another depth hashes differently
    rep = list(range(16)) * 2
    a, b = block_hashes(rep)
    assert a != b


# -- 2. parity with HFEngine -----------------------------------------------------------------------

FAMILIES = ["qwen2", "llama", "llama-mqa", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_hf_engine(family, fast):
    model = _model(family)
    lengths = [3, 9, 20, 33, 17]
    prompts = _prompts(_vocab(model), lengths, seed=1)
    dup = prompts[3]
    prompts += [dup, dup, dup, prompts[0]]  # identical prompts in one round: followers
    params = [SamplingParams(temperature=0.0, max_new_tokens=12),
              SamplingParams(temperature=1.0, max_new_tokens=10, seed=11),
              SamplingParams(temperature=1.0, max_new_tokens=7, seed=12),
              SamplingParams(temperature=0.0, max_new_tokens=9),
              SamplingParams(temperature=0.8, max_new_tokens=11, seed=13),
              SamplingParams(temperature=1.0, max_new_tokens=9, seed=14),
              SamplingParams(temperature=1.0, max_new_tokens=9, seed=15),
              SamplingParams(temperature=1.0, max_new_tokens=9, seed=14),  # same seed as two before
              SamplingParams(temperature=1.0, max_new_tokens=12, seed=11)]
    want = _run(_hf(model), prompts, params)
    engine = fast(model)
    got = _run(engine, prompts, params)
    _assert_same(got, want)
    assert got[5].token_ids == got[7].token_ids and got[5].token_ids != got[6].token_ids
    assert all(c.finish_reason == "length" and len(c.token_ids) == p.max_new_tokens for c, p in zip(got, params))
    # all arrived in one admission round: each distinct prompt was prefilled once, the copies copied
    assert engine.stats["requests"] == len(prompts)
    assert engine.stats["prefill_tokens"] == sum(lengths)
    assert engine.stats["reused_tokens"] == 3 * len(dup) + len(prompts[0])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_small_prefill_groups_and_chunks_match_hf(family, fast):
    model = _model(family)
    prompts = _prompts(_vocab(model), [30, 5, 21, 12], seed=3)
    params = [SamplingParams(temperature=1.0, max_new_tokens=9, seed=40 + i) for i in range(4)]
    want = _run(_hf(model), prompts, params)
    for chunk, prefill in [(1, 8), (3, 25), (16, 16384)]:
        _assert_same(_run(fast(model, decode_chunk=chunk, prefill_tokens=prefill), prompts, params), want)


# -- 3. top-k / top-p ----------------------------------------------------------------------------------

@torch.no_grad()
def _filtered_logprobs(model, prompt, completion, temperature, top_k, top_p) -> list[float]:
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float() / temperature
    n = logits.shape[0]
    filtered = filter_logits(logits, [top_k] * n, torch.full((n, 1), top_p))
    lp = torch.log_softmax(filtered, -1)
    return lp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_top_k_top_p_match_hf_and_report_the_filtered_distribution(family, fast):
    model = _model(family)
    prompts = _prompts(_vocab(model), [6, 19, 11, 25, 8], seed=5)
    params = [SamplingParams(temperature=1.0, top_k=5, max_new_tokens=10, seed=1),
              SamplingParams(temperature=0.7, top_p=0.5, max_new_tokens=10, seed=2),
              SamplingParams(temperature=1.3, top_k=40, top_p=0.8, max_new_tokens=10, seed=3),
              SamplingParams(temperature=1.0, max_new_tokens=10, seed=4),  # untruncated beside truncated rows
              SamplingParams(temperature=0.0, top_k=3, max_new_tokens=10)]  # greedy ignores truncation
    want = _run(_hf(model), prompts, params)
    got = _run(fast(model), prompts, params)
    _assert_same(got, want)
    for prompt, p, c in zip(prompts, params, got):
        t = p.temperature if p.temperature > 0 else 1.0
        k, top_p = (p.top_k, p.top_p) if p.temperature > 0 else (0, 1.0)
        expected = _filtered_logprobs(model, prompt, c.token_ids, t, k, top_p)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
        if k or top_p < 1.0:  # truncation raises every kept token's log-prob
            plain = _filtered_logprobs(model, prompt, c.token_ids, t, 0, 1.0)
            assert all(a > b + 1e-4 for a, b in zip(c.logprobs, plain))
    assert all(lp == 0.0 or lp < 0 for lp in got[1].logprobs)


def test_top_k_one_is_greedy(fast):
    model = _model("llama")
    prompts = _prompts(_vocab(model), [7, 18], seed=6)
    engine = fast(model)
    g = _run(engine, prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    k1 = _run(engine, prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8, seed=3))
    assert [c.token_ids for c in g] == [c.token_ids for c in k1]
    assert all(lp == pytest.approx(0.0, abs=1e-6) for c in k1 for lp in c.logprobs)


# -- 4. batch independence -------------------------------------------------------------------------

def test_a_seeded_request_samples_the_same_alone_or_anywhere_in_a_batch(fast):
    model = _model("qwen2")
    prompts = _prompts(_vocab(model), [12, 4, 27, 9, 16], seed=7)
    target, target_params = prompts[0], SamplingParams(temperature=1.0, max_new_tokens=14, seed=777)
    others = [SamplingParams(temperature=1.0, max_new_tokens=n, seed=n) for n in (3, 20, 8, 14)]
    alone = _run(fast(model), [target], target_params)[0]
    first = _run(fast(model, seed=5), [target] + prompts[1:], [target_params] + others)[0]
    last = _run(fast(model, seed=9), prompts[1:] + [target], others + [target_params])[-1]
    small = _run(fast(model, max_batch_size=2, decode_chunk=3), prompts[1:] + [target], others + [target_params])[-1]
    for c in (first, last, small):
        _assert_same([c], [alone])
    # another seed samples something else
    reseeded = _run(fast(model), [target], SamplingParams(temperature=1.0, max_new_tokens=14, seed=778))[0]
    assert reseeded.token_ids != alone.token_ids


def test_unseeded_requests_are_reproducible_per_engine_seed(fast):
    model = _model("llama")
    prompts = _prompts(_vocab(model), [5, 6, 7], seed=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)

    def ids(engine):
        out = []
        for p in prompts:  # one at a time: the engine's seed stream is drawn in request order
            out.append(_run(engine, [p], params)[0].token_ids)
        return out

    assert ids(fast(model, seed=3)) == ids(fast(model, seed=3)) == ids(_hf(model, seed=3))
    assert ids(fast(model, seed=3)) != ids(fast(model, seed=4))


# -- 5. prefix reuse across turns ------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_next_turn_reuses_the_parked_conversation(family, fast):
    model = _model(family)
    vocab = _vocab(model)
    p1 = _prompts(vocab, [21], seed=9)[0]
    engine = fast(model)
    t1 = _run(engine, [p1], SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))[0]
    assert len(t1.token_ids) == 8
    assert engine.stats["reused_tokens"] == 0 and engine.stats["prefill_tokens"] == 21
    assert engine.table.parked == {0: tuple(p1 + t1.token_ids[:-1])}

    obs = _prompts(vocab, [5], seed=10)[0]
    p2 = p1 + t1.token_ids + obs
    params2 = SamplingParams(temperature=1.0, max_new_tokens=10, seed=2)
    t2 = _run(engine, [p2], params2)[0]
    kept = len(p1) + len(t1.token_ids) - 1  # the last sampled id has no keys and values yet
    assert engine.stats["reused_tokens"] == kept
    assert engine.stats["prefill_tokens"] == 21 + len(p2) - kept == 21 + len(obs) + 1

    fresh = _run(fast(model), [p2], params2)[0]
    reference = _run(_hf(model), [p2], params2)[0]
    _assert_same([t2], [fresh])
    _assert_same([t2], [reference])

    # two continuations of the parked turn 2 in one round: the first claims its slot, the second
    # copies the shared prefix into a free slot; both prefill only their tails
    kept2 = len(p2) + len(t2.token_ids) - 1
    branches = [p2 + t2.token_ids + _prompts(vocab, [n], seed=20 + n)[0] for n in (3, 6)]
    params3 = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=3),
               SamplingParams(temperature=0.0, max_new_tokens=6)]
    before_reused, before_prefill = engine.stats["reused_tokens"], engine.stats["prefill_tokens"]
    got = _run(engine, branches, params3)
    assert engine.stats["reused_tokens"] - before_reused == 2 * kept2
    assert engine.stats["prefill_tokens"] - before_prefill == (3 + 1) + (6 + 1)
    _assert_same(got, _run(_hf(model), branches, params3))

    # a group of identical next-turn prompts: the leader extends the parked slot, the others copy it
    kept3 = len(branches[0]) + len(got[0].token_ids) - 1
    group = [branches[0] + got[0].token_ids + [7, 8]] * 3
    params4 = [SamplingParams(temperature=1.0, max_new_tokens=5, seed=s) for s in (1, 2, 3)]
    before_reused, before_prefill = engine.stats["reused_tokens"], engine.stats["prefill_tokens"]
    got4 = _run(engine, group, params4)
    assert engine.stats["prefill_tokens"] - before_prefill == 3
    assert engine.stats["reused_tokens"] - before_reused == kept3 + 2 * len(group[0])
    _assert_same(got4, _run(_hf(model), group, params4))


def test_a_shorter_shared_prefix_is_reused_and_the_rest_recomputed(fast):
    model = _model("llama")
    vocab = _vocab(model)
    base = _prompts(vocab, [40], seed=11)[0]
    engine = fast(model)
    _run(engine, [base], SamplingParams(temperature=0.0, max_new_tokens=4))
    other = base[:25] + _prompts(vocab, [10], seed=12)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    got = _run(engine, [other], params)[0]
    assert engine.stats["reused_tokens"] == 25
    assert engine.stats["prefill_tokens"] == 40 + 10
    _assert_same([got], _run(_hf(model), [other], params))


# -- 6. continuous batching ------------------------------------------------------------------------

def test_a_short_request_arriving_later_finishes_before_long_ones(fast):
    model = _model("qwen2")
    prompts = _prompts(_vocab(model), [10, 14, 18, 6], seed=13)
    long = [SamplingParams(temperature=1.0, max_new_tokens=60, seed=i) for i in range(3)]
    short = SamplingParams(temperature=1.0, max_new_tokens=3, seed=99)
    alone = _run(fast(model), [prompts[3]], short)[0]
    engine = fast(model, decode_chunk=2)
    order: list[str] = []

    async def one(name, prompt, params):
        c = await engine.generate(prompt, params)
        order.append(name)
        return c

    async def late():
        while engine.stats["decode_steps"] < 4:  # the long ones are decoding
            await asyncio.sleep(0.001)
        steps_at_arrival = engine.stats["decode_steps"]
        c = await one("short", prompts[3], short)
        return c, steps_at_arrival

    async def go():
        tasks = [asyncio.ensure_future(one(f"long{i}", prompts[i], long[i])) for i in range(3)]
        late_result = await late()
        return await asyncio.gather(*tasks), late_result

    longs, (short_result, steps_at_arrival) = asyncio.run(go())
    assert steps_at_arrival < 59, "the long requests were already finished: the test proves nothing"
    assert order[0] == "short", order
    _assert_same([short_result], [alone])
    _assert_same(longs, _run(_hf(model), prompts[:3], long))


# -- 7. more requests than slots -------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 4])
def test_more_requests_than_slots(fast, chunk):
    model = _model("llama")
    prompts = _prompts(_vocab(model), [5, 30, 12, 8, 22, 17], seed=14)
    params = [SamplingParams(temperature=1.0 if i % 3 else 0.0, max_new_tokens=4 + 3 * i, seed=i) for i in range(6)]
    engine = fast(model, max_batch_size=2, decode_chunk=chunk)
    got = _run(engine, prompts, params)
    _assert_same(got, _run(_hf(model), prompts, params))
    assert engine.stats["requests"] == 6 and not engine._rows and not engine.table.active
    assert len(engine.table.parked) == 2


# -- 8. stops and budgets -----------------------------------------------------------------------

def _letters(ids) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


def test_stop_ids_stop_strings_and_budgets_match_hf(fast):
    model = _model("llama")  # (the random qwen2-test model repeats one token greedily)
    vocab = _vocab(model)
    prompt = _prompts(vocab, [13], seed=15)[0]
    free = _run(_hf(model), [prompt], SamplingParams(temperature=0.0, max_new_tokens=30))[0].token_ids
    engine = fast(model, decode=_letters, decode_chunk=8)
    hf = _hf(model, decode=_letters)

    def both(prompts, params):
        got, want = _run(engine, prompts, params), _run(hf, prompts, params)
        _assert_same(got, want)
        return got

    # stop id: the completion ends at its first occurrence, stop id included, nothing after
    stop = free[5]
    first = free.index(stop)
    assert first == 5 and len(set(free)) > 20
    c = both([prompt], SamplingParams(temperature=0.0, max_new_tokens=30, stop_ids=(stop, vocab + 7)))[0]
    assert c.token_ids == free[: first + 1] and c.finish_reason == "stop" and c.closed

    # stop string: the text of ids 9 and 10
    text = _letters(free[9:11])
    end = next(k for k in range(1, 31) if text in _letters(free[:k]))
    c = both([prompt], SamplingParams(temperature=0.0, max_new_tokens=30, stop_strings=(text,)))[0]
    assert c.token_ids == free[:end] and c.finish_reason == "stop_string" and end <= 11

    # budget
    c = both([prompt], SamplingParams(temperature=0.0, max_new_tokens=5))[0]
    assert c.token_ids == free[:5] and c.finish_reason == "length" and c.truncated

    # a stop on the very first token (decided from the prefill's logits)
    c = both([prompt], SamplingParams(temperature=0.0, max_new_tokens=30, stop_ids=(free[0],)))[0]
    assert c.token_ids == free[:1] and c.finish_reason == "stop"
    c = both([prompt], SamplingParams(temperature=0.0, max_new_tokens=1))[0]
    assert c.token_ids == free[:1] and c.finish_reason == "length"

    # a prompt at or beyond max_total_tokens: nothing sampled; one just below: the room left
    at_limit = _prompts(vocab, [MAX_TOTAL, MAX_TOTAL + 5], seed=16)
    for c in both(at_limit, SamplingParams(temperature=0.0, max_new_tokens=5)):
        assert c.token_ids == [] and c.logprobs == [] and c.finish_reason == "length"
    near = _prompts(vocab, [MAX_TOTAL - 3], seed=17)[0]
    c = both([near], SamplingParams(temperature=1.0, max_new_tokens=10, seed=1))[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"

    # stops beside other rows in one batch don't end them
    params = [SamplingParams(temperature=0.0, max_new_tokens=30, stop_ids=(stop,)),
              SamplingParams(temperature=1.0, max_new_tokens=20, seed=5),
              SamplingParams(temperature=0.0, max_new_tokens=30, stop_strings=(text,))]
    batch = both([prompt, prompt[:7], prompt], params)
    assert batch[0].token_ids == free[: first + 1] and batch[2].token_ids == free[:end]
    assert len(batch[1].token_ids) == 20


# -- 9. load_weights -------------------------------------------------------------------------------

def test_load_weights(fast):
    model = _model("llama")
    other = _model("llama", seed=1)
    prompt = _prompts(_vocab(model), [20], seed=18)[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine = fast(model)
    before = _run(engine, [prompt], params)[0]
    assert before.policy_version == 0 == engine.policy_version
    again = _run(engine, [prompt], params)[0]  # the same prompt reuses its parked slot
    assert engine.stats["reused_tokens"] == len(prompt) - 1
    assert again.token_ids == before.token_ids

    engine.load_weights(other.state_dict(), version=3)
    assert engine.policy_version == 3 and engine.table.parked == {}
    after = _run(engine, [prompt], params)[0]
    assert after.policy_version == 3
    assert engine.stats["reused_tokens"] == len(prompt) - 1  # nothing computed by old weights is reused
    assert after.token_ids != before.token_ids
    _assert_same([after], _run(_hf(other), [prompt], params))

    # partial: only the tensors given change
    norm = {"model.norm.weight": torch.linspace(0.5, 3.0, model.config.hidden_size)}
    engine.load_weights(norm, version=4, partial=True)
    reference = _hf(other)
    reference.load_weights(norm, version=4, partial=True)
    partial = _run(engine, [prompt], params)[0]
    assert partial.policy_version == 4
    assert partial.logprobs != after.logprobs
    _assert_same([partial], _run(reference, [prompt], params))

    with pytest.raises(KeyError):
        engine.load_weights({"model.no_such.weight": torch.zeros(1)}, version=5, partial=True)
    incomplete = dict(other.state_dict())
    del incomplete["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(KeyError):
        engine.load_weights(incomplete, version=5)
    assert engine.policy_version == 4
    _assert_same(_run(engine, [prompt], params), [partial])  # still serving the same weights


def test_load_weights_during_sampling_is_refused(fast):
    model = _model("llama")
    engine = fast(model, decode_chunk=1)
    prompt = _prompts(_vocab(model), [10], seed=19)[0]

    async def go():
        task = asyncio.ensure_future(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=200,
                                                                            seed=1)))
        while engine.stats["decode_steps"] < 2:
            await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError, match="load_weights"):
            engine.load_weights(model.state_dict(), version=1)
        return await task

    c = asyncio.run(go())
    assert len(c.token_ids) == 200 and engine.policy_version == 0


# -- 10. cancellation ------------------------------------------------------------------------------

def test_cancelled_request_does_not_break_the_others(fast):
    model = _model("qwen2")
    prompts = _prompts(_vocab(model), [9, 16, 23], seed=20)
    params = [SamplingParams(temperature=1.0, max_new_tokens=50, seed=i) for i in range(3)]
    engine = fast(model, decode_chunk=2)

    async def go():
        tasks = [asyncio.ensure_future(engine.generate(p, q)) for p, q in zip(prompts, params)]
        while engine.stats["decode_steps"] < 6:
            await asyncio.sleep(0.001)
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return done

    done = asyncio.run(go())
    assert isinstance(done[1], asyncio.CancelledError)
    want = _run(_hf(model), prompts, params)
    _assert_same([done[0], done[2]], [want[0], want[2]])
    assert not engine._rows and not engine.table.active
    # the engine keeps serving, the cancelled slot included
    more = _prompts(_vocab(model), [11, 12, 13], seed=21)
    more_params = [SamplingParams(temperature=1.0, max_new_tokens=7, seed=10 + i) for i in range(3)]
    _assert_same(_run(engine, more, more_params), _run(_hf(model), more, more_params))


def test_cancelled_before_admission_is_skipped(fast):
    model = _model("llama")
    prompts = _prompts(_vocab(model), [9, 16, 23], seed=22)
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    engine = fast(model, max_batch_size=1)

    async def go():
        tasks = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
        await asyncio.sleep(0)  # all queued; only the first has a slot
        tasks[2].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    done = asyncio.run(go())
    assert isinstance(done[2], asyncio.CancelledError)
    want = _run(_hf(model), prompts[:2], params)
    _assert_same(done[:2], want)
    assert engine.stats["requests"] == 2


# -- 11. errors --------------------------------------------------------------------------------------

def test_bad_requests_raise(fast):
    model = _model("llama")
    engine = fast(model)
    with pytest.raises(ValueError, match="empty"):
        _run(engine, [[]], SamplingParams())
    with pytest.raises(ValueError, match="decode"):
        _run(engine, [[3, 4, 5]], SamplingParams(stop_strings=("x",)))
    # still serving
    assert len(_run(engine, [[3, 4, 5]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2


def test_unsupported_models_are_refused_with_a_reason():
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    lora = peft.get_peft_model(copy.deepcopy(_model("llama")), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(UnsupportedModel, match="PEFT"):
        FastEngine(lora, pad_token_id=0, max_total_tokens=64)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=64))
    with pytest.raises(UnsupportedModel, match="gpt2"):
        FastEngine(gpt2, pad_token_id=0, max_total_tokens=64)
    assert issubclass(UnsupportedModel, ValueError)
    with pytest.raises(ValueError):
        FastEngine(copy.deepcopy(_model("llama")), pad_token_id=0, max_total_tokens=64, decode_chunk=0)


def test_make_engine_kinds():
    from ctxrl.engine.factory import make_engine

    model = copy.deepcopy(_model("llama"))
    kw = dict(pad_token_id=0, max_batch_size=4, seed=0, max_total_tokens=64)
    assert isinstance(make_engine(model, kind="auto", **kw), HFEngine)  # CPU: the HF engine
    assert isinstance(make_engine(model, kind="hf", **kw), HFEngine)
    engine = make_engine(model, kind="fast", **kw)
    assert isinstance(engine, FastEngine) and engine.max_total_tokens == 64
    engine.close()
    with pytest.raises(ValueError, match="rollout.engine"):
        make_engine(model, kind="vllm", **kw)


def test_close_then_generate_fails(fast):
    model = _model("llama")
    engine = fast(model)
    assert len(_run(engine, [[3, 4, 5]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2
    engine.close()
    assert engine._thread is None
    with pytest.raises(RuntimeError, match="closed"):
        _run(engine, [[3, 4, 5]], SamplingParams(max_new_tokens=2))


# -- 12. event loops -------------------------------------------------------------------------------

def test_successive_event_loops_share_the_worker(fast):
    model = _model("qwen2")
    prompts = _prompts(_vocab(model), [8, 14], seed=23)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=4)
    engine = fast(model)
    first = _run(engine, prompts, params)
    thread = engine._thread
    second = _run(engine, prompts, params)
    assert engine._thread is thread and thread.is_alive()
    _assert_same(second, first)
    _assert_same(first, _run(_hf(model), prompts, params))


# -- 13. decode attention --------------------------------------------------------------------------

def _naive_attention(q, k, v, positions, scale):
    rows, kv_heads, group, dim = q.shape
    out = torch.zeros_like(q)
    for b in range(rows):
        n = int(positions[b]) + 1
        for h in range(kv_heads):
            for g in range(group):
                scores = [float((q[b, h, g] * k[b, h, j]).sum()) * scale for j in range(n)]
                m = max(scores)
                w = [pow(2.718281828459045, s - m) for s in scores]
                total = sum(w)
                out[b, h, g] = sum(wj / total * v[b, h, j] for j, wj in enumerate(w))
    return out


def test_reference_attention_matches_a_loop():
    torch.manual_seed(0)
    rows, heads, group, dim, slots, capacity = 3, 2, 3, 8, 5, 40
    q = torch.randn(rows, heads, group, dim)
    k, v = torch.randn(slots, heads, capacity, dim), torch.randn(slots, heads, capacity, dim)
    positions = torch.tensor([0, 17, 31])
    scale = dim ** -0.5
    want = _naive_attention(q, k, v, positions, scale)
    for key_len in (32, 40):  # the bucket only bounds the reads
        got = reference_attention(q, k, v, positions, scale, key_len)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(decode_attention(q, k, v, positions, scale, 32), want, atol=1e-5, rtol=0)
    # position 0 attends to key 0 alone: the output is that value
    torch.testing.assert_close(want[0], v[0, :, :1].expand(heads, group, dim))


TRITON_SCRIPT = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton.runtime.interpreter as interpreter
    original = interpreter._patch_lang_tensor
    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = patched
    from ctxrl.engine.fast import attention as A
    assert A.triton is not None
    torch.manual_seed(0)
    worst = 0.0
    for rows, heads, group, dim, slots, capacity, pos in [(3, 2, 7, 16, 4, 200, [5, 130, 70]),
                                                          (2, 1, 4, 32, 2, 100, [0, 99])]:
        q = torch.randn(rows, heads, group, dim)
        k, v = torch.randn(slots, heads, capacity, dim), torch.randn(slots, heads, capacity, dim)
        positions = torch.tensor(pos)
        ref = A.reference_attention(q, k, v, positions, dim ** -0.5, capacity)
        out = A.decode_attention(q, k, v, positions, dim ** -0.5, capacity, use_triton=True)
        worst = max(worst, float((ref - out).abs().max()))
    print("MAXERR", worst)
""")


def test_triton_decode_kernel_in_interpreter_mode():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-3000:]
    err = float(result.stdout.split("MAXERR")[-1])
    assert err < 1e-4


# -- many episodes, many turns, staggered arrivals ---------------------------------------------------

@pytest.mark.parametrize("slots,chunk", [(3, 4), (6, 1)])
def test_concurrent_multi_turn_episodes_match_hf(fast, slots, chunk):
    """Eight episodes of four turns (each turn extends the last), arriving at random times into fewer
    slots than episodes: every completion equals HFEngine's on the same prompt and parameters."""
    model = _model("llama")
    rng = random.Random(slots)
    engine = fast(model, max_total_tokens=200, max_batch_size=slots, decode_chunk=chunk)
    system = _prompts(_vocab(model), [18], seed=slots)[0]
    log: list[tuple[list[int], SamplingParams, Completion]] = []

    async def episode(group: int):
        prompt = system + [rng.randrange(2, 300) for _ in range(group)]
        for _ in range(4):
            await asyncio.sleep(rng.random() * 0.01)
            kind = rng.randrange(3)
            params = SamplingParams(temperature=[0.0, 1.0, 0.9][kind], top_p=[1.0, 1.0, 0.9][kind],
                                    max_new_tokens=rng.randrange(1, 20), seed=rng.randrange(10**6),
                                    stop_ids=(5, 6, 7))
            c = await engine.generate(prompt, params)
            log.append((list(prompt), params, c))
            prompt = prompt + c.token_ids + [rng.randrange(2, 300) for _ in range(rng.randrange(1, 6))]

    async def go():
        await asyncio.gather(*(episode(3 * (i // 2)) for i in range(8)))  # pairs share their first prompt

    asyncio.run(go())
    assert len(log) == 32
    want = _run(_hf(model, max_total_tokens=200), [p for p, _, _ in log], [q for _, q, _ in log])
    _assert_same([c for _, _, c in log], want)
    assert engine.stats["reused_tokens"] > engine.stats["prefill_tokens"] / 2
    assert not engine._rows and not engine.table.active


# -- a failing admission ----------------------------------------------------------------------------


def test_a_failing_prefill_is_reported_to_its_request(fast):
    model = _model("llama")
    engine = fast(model)
    bad = [3, 4, 10**6]  # an id beyond the embedding: the prefill raises IndexError (HFEngine raises it too)

    async def go():
        return await asyncio.wait_for(engine.generate(bad, SamplingParams(max_new_tokens=3)), timeout=2)

    with pytest.raises(IndexError):
        asyncio.run(go())


def test_a_failing_prefill_frees_its_slot(fast):
    model = _model("llama")
    engine = fast(model, max_batch_size=1)

    async def go(prompt):
        try:
            return await asyncio.wait_for(engine.generate(prompt, SamplingParams(max_new_tokens=3)), timeout=1)
        except (IndexError, asyncio.TimeoutError) as exc:
            return exc

    asyncio.run(go([3, 4, 10**6]))
    assert engine.table.active == set()
    c = asyncio.run(go([3, 4, 5]))
    assert isinstance(c, Completion) and len(c.token_ids) == 3


# -- the fused steps equal the HF modules they replace -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_steps_equal_the_hf_modules(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from ctxrl.models import fused

    torch.manual_seed(0)
    norm = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    norm.weight.data.normal_()
    x, delta = torch.randn(5, 32, dtype=dtype) * 3, torch.randn(5, 32, dtype=dtype)
    assert torch.equal(fused.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    total, normed = fused.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
    assert torch.equal(total, x + delta) and torch.equal(normed, norm(x + delta))
    q, k = torch.randn(5, 4, 16, dtype=dtype), torch.randn(5, 2, 16, dtype=dtype)
    cos, sin = torch.randn(5, 1, 16, dtype=dtype), torch.randn(5, 1, 16, dtype=dtype)
    # HF's layout is [batch, heads, tokens, dim] with cos/sin [batch, tokens, dim]
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                  cos.transpose(0, 1), sin.transpose(0, 1))
    assert torch.equal(fused.rotate(q, cos, sin), hq[0].transpose(0, 1))
    assert torch.equal(fused.rotate(k, cos, sin), hk[0].transpose(0, 1))
    gate, up = torch.randn(5, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype)
    assert torch.equal(fused.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)


def test_a_fused_step_that_fails_to_compile_runs_eagerly(monkeypatch, caplog):
    from ctxrl.models import fused

    def broken(fn, **_):
        def call(*args):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(fused.torch, "compile", broken)
    steps = fused.Fused(compile=True)
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    with caplog.at_level("WARNING"):
        out = steps.silu_mul(gate, up)
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)
    assert not steps.compiled and "silu_mul" in caplog.text and "no compiler here" in caplog.text
    assert torch.equal(steps.silu_mul(gate, up), out)  # and stays eager, without trying again
