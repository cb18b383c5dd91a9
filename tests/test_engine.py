"""HFEngine: batching, behaviour log-probs, greedy/stop/length semantics, filtering, weight updates."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

from ctxrl.engine.base import Completion, SamplingParams
from ctxrl.engine.hf import HFEngine
from ctxrl.train.learner import token_logprobs


def _prompts(vocab: int, n: int = 10, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def _gather(engine, prompts, params):
    async def go():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return asyncio.run(go())


def _engine(model, tokenizer, **kw) -> HFEngine:
    return HFEngine(model, pad_token_id=tokenizer.pad_token_id, **kw)


@torch.no_grad()
def _greedy_by_hand(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids = list(prompt)
    out, lps = [], []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        tok = int(logits.argmax())
        out.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return out, lps


@torch.no_grad()
def _recomputed(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    lp = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)[0]
    return lp[len(prompt) - 1:].tolist()


def test_concurrent_requests_form_one_batch(model, tokenizer):
    engine = _engine(model, tokenizer)
    prompts = _prompts(len(tokenizer))
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    results = _gather(engine, prompts, params)
    assert engine.stats["batches"] == 1
    assert engine.stats["requests"] == 10
    assert len(results) == 10
    for c in results:
        assert isinstance(c, Completion)
        assert len(c.token_ids) == len(c.logprobs) == 6
        assert c.finish_reason == "length"
        assert all(lp <= 0.0 for lp in c.logprobs)
    # a second round is a second batch
    _gather(engine, prompts[:3], params)
    assert engine.stats["batches"] == 2 and engine.stats["requests"] == 13


def test_max_batch_size_splits(model, tokenizer):
    engine = _engine(model, tokenizer, max_batch_size=4)
    results = _gather(engine, _prompts(len(tokenizer)), SamplingParams(max_new_tokens=2))
    assert engine.stats["batches"] == 3 and engine.stats["requests"] == 10
    assert all(len(c.token_ids) == 2 for c in results)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_learner(model, tokenizer, temperature):
    engine = _engine(model, tokenizer, seed=1)
    prompts = _prompts(len(tokenizer), n=6, seed=2)
    results = _gather(engine, prompts, SamplingParams(temperature=temperature, max_new_tokens=8))
    assert engine.stats["batches"] == 1
    for prompt, c in zip(prompts, results):
        expected = _recomputed(model, prompt, c.token_ids, temperature)
        assert len(expected) == len(c.logprobs) == 8
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def test_temperature_changes_logprobs(model, tokenizer):
    prompt = _prompts(len(tokenizer), n=1)[0]
    hot = _gather(_engine(model, tokenizer), [prompt], SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    # the same tokens scored at T=0.7 give different (recomputed) log-probs than at T=1
    at1 = _recomputed(model, prompt, hot.token_ids, 1.0)
    at07 = _recomputed(model, prompt, hot.token_ids, 0.7)
    torch.testing.assert_close(torch.tensor(hot.logprobs), torch.tensor(at1), atol=1e-4, rtol=0)
    assert max(abs(a - b) for a, b in zip(at1, at07)) > 1e-3


def test_greedy_is_deterministic_and_matches_argmax(model, tokenizer):
    prompts = _prompts(len(tokenizer), n=4, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=7)
    first = _gather(_engine(model, tokenizer, seed=0), prompts, params)
    second = _gather(_engine(model, tokenizer, seed=123), prompts, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    for prompt, c in zip(prompts, first):
        tokens, lps = _greedy_by_hand(model, prompt, 7)
        assert c.token_ids == tokens
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lps), atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible(model, tokenizer):
    prompts = _prompts(len(tokenizer), n=3, seed=9)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    a = _gather(_engine(model, tokenizer, seed=7), prompts, params)
    b = _gather(_engine(model, tokenizer, seed=7), prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_stop_ids(model, tokenizer):
    prompt = _prompts(len(tokenizer), n=1, seed=11)[0]
    tokens, _ = _greedy_by_hand(model, prompt, 8)
    stop = tokens[3]
    first = tokens.index(stop)
    c = _gather(_engine(model, tokenizer), [prompt],
                SamplingParams(temperature=0.0, max_new_tokens=8, stop_ids=(stop,)))[0]
    assert c.finish_reason == "stop"
    assert c.token_ids == tokens[: first + 1]
    assert c.token_ids[-1] == stop
    assert len(c.logprobs) == len(c.token_ids)


def test_stop_in_batch_does_not_affect_other_rows(model, tokenizer):
    prompts = _prompts(len(tokenizer), n=2, seed=11)
    tokens0, _ = _greedy_by_hand(model, prompts[0], 8)
    tokens1, _ = _greedy_by_hand(model, prompts[1], 8)
    stop = tokens0[1]
    engine = _engine(model, tokenizer)

    async def go():
        return await asyncio.gather(
            engine.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=8, stop_ids=(stop,))),
            engine.generate(prompts[1], SamplingParams(temperature=0.0, max_new_tokens=8)))
    a, b = asyncio.run(go())
    assert engine.stats["batches"] == 1
    assert a.token_ids == tokens0[: tokens0.index(stop) + 1] and a.finish_reason == "stop"
    assert b.token_ids == tokens1 and b.finish_reason == "length"


def test_max_new_tokens_length(model, tokenizer):
    prompts = _prompts(len(tokenizer), n=3, seed=4)
    engine = _engine(model, tokenizer)

    async def go():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=n))
                                      for p, n in zip(prompts, (1, 5, 9))))
    results = asyncio.run(go())
    assert [len(c.token_ids) for c in results] == [1, 5, 9]
    assert [c.finish_reason for c in results] == ["length"] * 3


def test_max_total_tokens(model, tokenizer):
    engine = _engine(model, tokenizer, max_total_tokens=20)
    prompt = _prompts(len(tokenizer), n=8)[7]  # 17 tokens
    assert len(prompt) == 17
    c = _gather(engine, [prompt], SamplingParams(max_new_tokens=10))[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"
    c = _gather(engine, [list(range(3, 23))], SamplingParams(max_new_tokens=10))[0]
    assert c.token_ids == [] and c.finish_reason == "length"


def test_empty_prompt_raises(model, tokenizer):
    with pytest.raises(ValueError):
        _gather(_engine(model, tokenizer), [[]], SamplingParams())


def test_top_k_one_equals_greedy(model, tokenizer):
    prompts = _prompts(len(tokenizer), n=3, seed=6)
    greedy = _gather(_engine(model, tokenizer), prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    topk = _gather(_engine(model, tokenizer, seed=99), prompts,
                   SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6))
    assert [c.token_ids for c in topk] == [c.token_ids for c in greedy]
    # log-probs are of the distribution each token was drawn from: top-1 is a point mass
    for c in topk:
        assert c.logprobs == [0.0] * len(c.token_ids)


def test_behaviour_logprobs_are_of_the_truncated_distribution(model, tokenizer):
    """top_k=3 then top_p=0.8: the reported log-prob is log(p_i / kept mass) under the filtered softmax."""
    prompt = _prompts(len(tokenizer), n=1, seed=21)[0]
    c = _gather(_engine(model, tokenizer), [prompt], SamplingParams(temperature=0.9, top_k=3, top_p=0.8,
                                                                    max_new_tokens=1, seed=5))[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float() / 0.9
    probs = torch.softmax(logits, -1)
    top = probs.topk(3)
    renormalised = top.values / top.values.sum()
    kept = [0]  # top-p over what top-k kept: keep a token while the mass before it is below 0.8
    for i in range(1, 3):
        if float(renormalised[:i].sum()) < 0.8:
            kept.append(i)
    assert int(c.token_ids[0]) in top.indices[kept].tolist()
    mass = float(top.values[kept].sum())
    expected = math.log(float(probs[c.token_ids[0]]) / mass)
    assert c.logprobs[0] == pytest.approx(expected, abs=1e-5)
    # without truncation they are the learner's log-probs at the same temperature
    free = _gather(_engine(model, tokenizer), [prompt], SamplingParams(temperature=0.9, max_new_tokens=4, seed=5))[0]
    torch.testing.assert_close(torch.tensor(free.logprobs), torch.tensor(_recomputed(model, prompt, free.token_ids,
                                                                                      0.9)), atol=1e-5, rtol=0)


def test_stop_strings_end_the_completion_where_the_text_reaches_them(model, tokenizer):
    prompt = _prompts(len(tokenizer), n=1, seed=3)[0]
    decode = tokenizer.decode
    free = _gather(_engine(model, tokenizer), [prompt], SamplingParams(temperature=0.0, max_new_tokens=24))[0]
    text = decode(free.token_ids)
    # a stop string that first appears in the text written by tokens 1..n (n >= 6)
    n = next(n for n in range(6, len(free.token_ids)) if decode(free.token_ids[:n]).strip()
             and decode(free.token_ids[n - 2:n]).strip())
    stop = decode(free.token_ids[n - 2:n])
    first = next(k for k in range(1, len(free.token_ids) + 1) if stop in decode(free.token_ids[:k]))
    c = _gather(_engine(model, tokenizer, decode=decode), [prompt],
                SamplingParams(temperature=0.0, max_new_tokens=24, stop_strings=(stop,)))[0]
    assert c.finish_reason == "stop_string" and not c.closed and not c.truncated
    assert c.token_ids == free.token_ids[:first]  # kept as sampled, up to the token that completed it
    assert text.startswith(decode(c.token_ids))
    with pytest.raises(ValueError, match="decode"):
        _gather(_engine(model, tokenizer), [prompt], SamplingParams(stop_strings=("x",)))
    with pytest.raises(ValueError, match="empty"):
        SamplingParams(stop_strings=("",))


def test_any_stop_id_ends_the_completion(model, tokenizer):
    prompt = _prompts(len(tokenizer), n=1, seed=9)[0]
    free = _gather(_engine(model, tokenizer), [prompt], SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    third = free.token_ids[2]
    first = free.token_ids.index(third)
    c = _gather(_engine(model, tokenizer), [prompt],
                SamplingParams(temperature=0.0, max_new_tokens=12, stop_ids=(10**6, third)))[0]
    assert c.finish_reason == "stop" and c.closed and c.token_ids == free.token_ids[:first + 1]


def test_tiny_top_p_equals_greedy(model, tokenizer):
    prompts = _prompts(len(tokenizer), n=2, seed=8)
    greedy = _gather(_engine(model, tokenizer), prompts, SamplingParams(temperature=0.0, max_new_tokens=5))
    nucleus = _gather(_engine(model, tokenizer, seed=3), prompts,
                      SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=5))
    assert [c.token_ids for c in nucleus] == [c.token_ids for c in greedy]


def test_load_weights_changes_outputs_and_version(model, tokenizer):
    engine_model = copy.deepcopy(model)
    engine = _engine(engine_model, tokenizer)
    prompts = _prompts(len(tokenizer), n=2, seed=12)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = _gather(engine, prompts, params)
    assert engine.policy_version == 0 and all(c.policy_version == 0 for c in before)

    g = torch.Generator().manual_seed(0)
    # parameters and all buffers (persistent or not), so this test does not depend on which
    # buffers state_dict() includes; see test_load_weights_accepts_state_dict for that
    full = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    perturbed = {k: (v.detach() + 0.5 * torch.randn(v.shape, generator=g)) if "rotary" not in k else v.clone()
                 for k, v in full.items()}
    engine.load_weights(perturbed, version=1)
    assert engine.policy_version == 1
    for name, p in engine_model.named_parameters():
        assert torch.equal(p.detach(), perturbed[name])
    after = _gather(engine, prompts, params)
    assert all(c.policy_version == 1 for c in after)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    assert any(a.token_ids != b.token_ids for a, b in zip(after, before)) or \
        max(abs(x - y) for a, b in zip(after, before) for x, y in zip(a.logprobs, b.logprobs)) > 1e-3
    # greedy outputs follow the new weights exactly
    assert after[0].token_ids == _greedy_by_hand(engine_model, prompts[0], 6)[0]
    # the session model was not touched
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), perturbed[name])

    engine.load_weights({k: v.detach().clone() for k, v in full.items()}, version=7)
    assert engine.policy_version == 7
    again = _gather(engine, prompts, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in before]

    with pytest.raises(KeyError):
        engine.load_weights({}, version=8)
    assert engine.policy_version == 7  # a refused load changes nothing


@pytest.mark.parametrize("kwargs", [{"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.1}, {"top_k": -1},
                                    {"max_new_tokens": 0}, {"max_new_tokens": -3}])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.stop_ids) == (1.0, 1.0, 0, 128, ())
    assert SamplingParams(top_p=1.0, top_k=0, max_new_tokens=1).max_new_tokens == 1
    assert math.isclose(SamplingParams(temperature=0.0).temperature, 0.0)


def test_load_weights_accepts_state_dict(model, tokenizer):
    """The documented way to sync weights: ``engine.load_weights(learner_model.state_dict(), version=step)``."""
    engine = _engine(copy.deepcopy(model), tokenizer)
    engine.load_weights(model.state_dict(), version=1)
    assert engine.policy_version == 1
    for (name, a), b in zip(engine.model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def test_batches_run_in_one_long_lived_worker_thread(model, tokenizer):
    import threading

    engine = _engine(model, tokenizer)
    names = []
    original = engine._decode

    def spy(*args):
        names.append(threading.current_thread().name)
        return original(*args)

    engine._decode = spy
    prompts = _prompts(len(tokenizer), n=2)
    _gather(engine, prompts, SamplingParams(max_new_tokens=2))
    _gather(engine, prompts, SamplingParams(max_new_tokens=2))  # a new event loop, the same thread
    assert len(names) == 2 and names[0] == names[1] and names[0].startswith("ctxrl-engine")
    assert names[0] != threading.current_thread().name
    engine.close()
    assert engine._executor is None
    assert len(_gather(engine, prompts, SamplingParams(max_new_tokens=2))) == 2  # usable after close
    engine.close()


def test_attention_kernels_keep_cuda_off_cudnn(monkeypatch):
    """Decoding, the learner, the warm start and the critic all run attention under this context."""
    import ctxrl.models.kernels as kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with kernels.attention_kernels(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with kernels.attention_kernels("cuda"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    monkeypatch.setattr(kernels, "ALLOW_CUDNN_ATTENTION", True)  # what benchmarks/gpu_memory.py compares against
    with kernels.attention_kernels("cuda"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_cache_fits_hands_back_the_allocator_cache_before_refusing(monkeypatch):
    """Memory a process freed (an earlier engine) sits in torch's cache, which mem_get_info does not count as
    free: cache_fits must empty the cache and ask again before it refuses, and still refuse what never fits."""
    from ctxrl.engine.capacity import cache_fits

    gib = 2**30
    state = {"free": 2 * gib, "cached": 6 * gib, "emptied": 0}

    def empty_cache():
        state["free"] += state["cached"]
        state["cached"] = 0
        state["emptied"] += 1

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], 80 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    cuda = torch.device("cuda", 0)
    assert cache_fits(1 * gib, cuda) is None and state["emptied"] == 0  # fits: the cache is left alone
    assert cache_fits(4 * gib, cuda) is None and state["emptied"] == 1  # fits once the cache is handed back
    assert cache_fits(9 * gib, cuda) == "9.0 GiB needed, 8.0 GiB free"
    assert cache_fits(9 * gib, torch.device("cpu")) is None  # no CUDA: nothing to check
