"""Sampling maths: counter-based uniforms, inverse-CDF draws, top-k / top-p filtering, and the
engine's batch-independent seeded sampling."""

from __future__ import annotations

import asyncio
import math

import torch

from ctxrl.engine.base import SamplingParams
from ctxrl.engine.hf import HFEngine
from ctxrl.engine.sampling import filter_logits, mix32, sample_inverse_cdf, uniforms
from ctxrl.seeds import derive_seed


def test_mix32_stays_in_32_bits_and_is_a_function():
    x = torch.tensor([0, 1, 2, 0xFFFFFFFF, 123456789], dtype=torch.long)
    h = mix32(x)
    assert bool(((h >= 0) & (h <= 0xFFFFFFFF)).all())
    assert torch.equal(h, mix32(x.clone()))
    assert len(set(h.tolist())) == 5


def test_uniforms_depend_only_on_seed_and_step():
    seeds = torch.tensor([5, 7, 5, (1 << 62) + 5], dtype=torch.long)
    u = uniforms(seeds, 3)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert u[0] == u[2]  # same seed, same step
    assert u[0] != u[1] and u[0] != u[3]  # the high 32 bits of a seed count too
    assert u[0] != uniforms(seeds, 4)[0]
    assert uniforms(seeds[1:2], 3)[0] == u[1]  # one row alone equals the same row in a batch


def test_uniforms_are_uniform():
    u = uniforms(torch.arange(200_000, dtype=torch.long), 0)
    assert abs(float(u.mean()) - 0.5) < 0.003
    assert abs(float(u.var()) - 1 / 12) < 0.002
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert float(counts.min()) > 19_000 and float(counts.max()) < 21_000
    # consecutive steps of one seed are not correlated
    a, b = uniforms(torch.arange(50_000, dtype=torch.long), 1), uniforms(torch.arange(50_000, dtype=torch.long), 2)
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02


def test_inverse_cdf_picks_the_interval_u_falls_in():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]] * 5)
    u = torch.tensor([0.05, 0.1, 0.5, 0.75, 0.999], dtype=torch.float64)
    # cdf = [0.1, 0.1, 0.7, 1.0]; u = 0.1 sits at the end of token 0's interval -> the next
    # token with mass, never the zero-probability token 1
    assert sample_inverse_cdf(probs, u).tolist() == [0, 2, 2, 3, 3]
    # unnormalised rows (masked softmax output) are scaled by their total
    assert sample_inverse_cdf(probs * 0.5, u).tolist() == [0, 2, 2, 3, 3]
    # u * total rounding up to the total falls back to the most likely token, not the last index
    edge = torch.tensor([[0.5, 0.5, 0.0]])
    assert sample_inverse_cdf(edge, torch.tensor([1.0], dtype=torch.float64)).tolist() == [0]


def test_inverse_cdf_matches_the_distribution():
    probs = torch.tensor([0.05, 0.5, 0.0, 0.15, 0.3])
    n = 40_000
    u = uniforms(torch.arange(n, dtype=torch.long) * 31 + 9, 0)
    draws = sample_inverse_cdf(probs.expand(n, -1), u)
    freq = torch.bincount(draws, minlength=5).double() / n
    assert freq[2] == 0
    for f, p in zip(freq.tolist(), probs.tolist()):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-9


def test_derive_seed_differs_per_salt_and_is_stable():
    s = [derive_seed(17, t) for t in range(100)]
    assert len(set(s)) == 100 and all(0 <= x < 1 << 63 for x in s)
    assert derive_seed(17, 3) == derive_seed(17, 3) != derive_seed(18, 3)
    assert derive_seed(-4, 0) >= 0  # negative seeds are reduced, not rejected


def test_seeded_request_samples_the_same_alone_or_in_any_batch(model, tokenizer):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tokenizer), (4 + 3 * i,), generator=g).tolist() for i in range(5)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=1000 + i) for i in range(5)]

    def run(order, engine_seed):
        engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, seed=engine_seed)

        async def go():
            return await asyncio.gather(*(engine.generate(prompts[i], params[i]) for i in order))
        return dict(zip(order, asyncio.run(go())))

    together = run([0, 1, 2, 3, 4], engine_seed=0)
    shuffled = run([3, 0, 4, 2, 1], engine_seed=99)
    alone = {i: run([i], engine_seed=i)[i] for i in (0, 4)}
    for i in range(5):
        assert shuffled[i].token_ids == together[i].token_ids
    for i, c in alone.items():
        assert c.token_ids == together[i].token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(together[i].logprobs), atol=1e-4, rtol=0)
    # different seeds give different samples (8 tokens from a ~2k vocab at T=1)
    other = run([0], engine_seed=0)
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id)
    reseeded = asyncio.run(engine.generate(prompts[0], SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)))
    assert other[0].token_ids == together[0].token_ids != reseeded.token_ids


def testfilter_logits_top_k():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, 0.0, 1.0, 2.0]])
    out = filter_logits(logits, [2, 0], torch.tensor([[1.0], [1.0]]))
    inf = float("-inf")
    assert out.tolist() == [[inf, 2.0, inf, 1.0], [3.0, 0.0, 1.0, 2.0]]
    out = filter_logits(logits, [1, 3], torch.tensor([[1.0], [1.0]]))
    assert out.tolist() == [[inf, 2.0, inf, inf], [3.0, inf, 1.0, 2.0]]
    # all disabled: unchanged
    assert torch.equal(filter_logits(logits, [0, 0], torch.tensor([[1.0], [1.0]])), logits)


def testfilter_logits_top_p():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]])
    p = torch.softmax(logits, -1)[0].tolist()  # sorted order: idx 1, 3, 0, 2
    # p = [0.1478, 0.6095, 0.0304, 0.2242]; cumulative mass before each sorted token: 0, .6095, .8337, .9696
    assert p[1] > 0.6 and 0.83 < p[1] + p[3] < 0.84 and p[1] + p[3] + p[0] > 0.96
    inf = float("-inf")

    def keep(top_p, k=0):
        out = filter_logits(logits, [k], torch.tensor([[top_p]]))[0]
        return [i for i, v in enumerate(out.tolist()) if v != inf]

    assert keep(0.5) == [1]  # mass before idx 3 is p[1] >= 0.5
    assert keep(0.6) == [1]
    assert keep(0.7) == [1, 3]
    assert keep(0.83) == [1, 3]
    assert keep(0.9) == [0, 1, 3]  # mass before idx 0 is .8337 < 0.9; before idx 2 it is .9696
    assert keep(0.99) == [0, 1, 2, 3]
    assert keep(1e-9) == [1]  # the top token always stays
    assert keep(0.9, k=2) == [1, 3]  # k and p combine
    assert keep(0.5, k=3) == [1]
    kept = filter_logits(logits, [0], torch.tensor([[0.9]]))[0]
    assert kept[[0, 1, 3]].tolist() == logits[0, [0, 1, 3]].tolist()  # kept values unchanged


def testfilter_logits_top_p_counts_mass_after_top_k():
    """HF / vLLM order: top-p is measured in the distribution renormalised over the top-k tokens."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    inf = float("-inf")
    # over the top 2 the masses are 0.625 and 0.375: the mass before the second (0.625) reaches 0.6,
    # so only the first stays (measured in the full distribution it would be 0.5 < 0.6: both would stay)
    out = filter_logits(logits, [2], torch.tensor([[0.6]]))
    assert [v != inf for v in out[0].tolist()] == [True, False, False]
    out = filter_logits(logits, [2], torch.tensor([[0.7]]))
    assert [v != inf for v in out[0].tolist()] == [True, True, False]


def testfilter_logits_per_row():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [0.5, 2.0, -1.0, 1.0]])
    out = filter_logits(logits, [0, 0], torch.tensor([[0.5], [1.0]]))
    assert torch.isinf(out[0]).tolist() == [True, False, True, True]
    assert torch.equal(out[1], logits[1])




def test_seeded_episodes_repeat_whatever_the_batching(model, tokenizer, renderer):
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.rollout.agent import run_episodes
    from ctxrl.rollout.spec import RolloutLimits

    tasks = CalculatorEnv.sample_tasks("train", 3, seed=4)
    limits = RolloutLimits(max_turns=2, max_new_tokens=12, max_total_tokens=512, temperature=1.0)

    def play(max_batch_size, engine_seed):
        engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, max_batch_size=max_batch_size,
                          seed=engine_seed)
        return asyncio.run(run_episodes(CalculatorEnv, tasks, engine, renderer, limits, group_size=2, seed=11))

    one_batch, small_batches = play(64, 0), play(2, 5)
    assert [e.input_ids for e in one_batch] == [e.input_ids for e in small_batches]
    assert [e.loss_mask for e in one_batch] == [e.loss_mask for e in small_batches]
    # the two episodes of a group are different samples
    assert any(one_batch[2 * i].input_ids != one_batch[2 * i + 1].input_ids for i in range(3))


# -- the two-level draw the fast engine uses ---------------------------------------------------------

def _sparse_weights(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(rows, vocab, generator=g) ** 3
    w[torch.rand(rows, vocab, generator=g) < 0.3] = 0.0
    w[:, -1] += (w.sum(-1) == 0).float()  # no all-zero row
    return w


def test_sample_blocked_equals_the_one_level_draw():
    from ctxrl.engine.sampling import sample_blocked

    for vocab in (1, 5, 300, 1000, 4096, 5000):
        for block in (1, 7, 16, 1024, 4096):
            w = _sparse_weights(300, vocab, seed=vocab + block)
            u = uniforms(torch.arange(300, dtype=torch.long) * 7 + block, vocab)
            blocked, flat = sample_blocked(w, u, block), sample_inverse_cdf(w, u)
            # the same draw up to float64 rounding at block edges (none with these draws)
            assert int((blocked != flat).sum()) <= 1, (vocab, block)
            assert bool((w.gather(-1, blocked.unsqueeze(-1)) > 0).all()), (vocab, block)
            assert bool(((blocked >= 0) & (blocked < vocab)).all())


def test_sample_blocked_never_picks_a_zero_weight_at_the_edges():
    from ctxrl.engine.sampling import sample_blocked

    # u at the top and bottom of (0, 1), mass only in the first, last or one middle entry of a
    # vocabulary whose last block is short (vocab 23 = 3 blocks of 7 + 2)
    extremes = torch.tensor([2.0 ** -53, 0.5, 1.0 - 2.0 ** -53, 1.0], dtype=torch.float64)
    for hot in (0, 6, 7, 13, 21, 22):
        w = torch.zeros(4, 23)
        w[:, hot] = 0.25
        for block in (7, 16, 1024):
            assert sample_blocked(w, extremes, block).tolist() == [hot] * 4
    # two tokens: u below / above the first's share of the mass
    w = torch.zeros(2, 23)
    w[:, 3], w[:, 20] = 1.0, 3.0
    for block in (1, 7, 16):
        assert sample_blocked(w, torch.tensor([0.2, 0.3], dtype=torch.float64), block).tolist() == [3, 20]


def test_sample_blocked_matches_the_distribution():
    from ctxrl.engine.sampling import sample_blocked

    probs = torch.tensor([0.05, 0.0, 0.15, 0.0, 0.0, 0.3, 0.1, 0.0, 0.0, 0.4])
    n = 40_000
    u = uniforms(torch.arange(n, dtype=torch.long) * 13 + 5, 0)
    draws = sample_blocked(probs.expand(n, -1).contiguous(), u, 3)
    freq = torch.bincount(draws, minlength=10).double() / n
    for f, p in zip(freq.tolist(), probs.tolist()):
        assert (f == 0) if p == 0 else abs(f - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_draw_with_per_row_steps_equals_one_row_at_a_time():
    from ctxrl.engine.sampling import draw

    g = torch.Generator().manual_seed(1)
    rows, vocab = 6, 2500
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.tensor([[1.0], [0.7], [1.0], [1.5], [1.0], [0.3]])
    greedy = torch.tensor([False, False, True, False, False, False])
    seeds = torch.tensor([11, 12, 13, 14, 11, (1 << 62) + 3], dtype=torch.long)
    steps = torch.tensor([0, 5, 2, 100, 1, 7], dtype=torch.long)
    choice, logprob = draw(logits, temperature, greedy, seeds, steps)
    for r in range(rows):
        c, lp = draw(logits[r:r + 1], temperature[r:r + 1], greedy[r:r + 1], seeds[r:r + 1], int(steps[r]))
        assert int(c) == int(choice[r])
        assert float(lp) == float(logprob[r])
    # same seed, other step: another uniform (rows 0 and 4 share seed 11, steps 0 and 1)
    u = uniforms(seeds, steps)
    assert u[0] != u[4] and u[0] == uniforms(seeds[:1], 0)[0]
    # an int step is the same step for every row
    same, _ = draw(logits, temperature, greedy, seeds, 5)
    as_tensor, _ = draw(logits, temperature, greedy, seeds, torch.full((rows,), 5, dtype=torch.long))
    assert torch.equal(same, as_tensor)


def test_draw_reports_the_log_prob_of_the_distribution_drawn_from():
    from ctxrl.engine.sampling import draw

    g = torch.Generator().manual_seed(2)
    rows, vocab = 5, 3000
    logits = torch.randn(rows, vocab, generator=g) * 4
    temperature = torch.tensor([[1.0], [0.5], [2.0], [1.0], [1.0]])  # engines pass T=1 for greedy rows
    greedy = torch.tensor([False, False, False, True, True])
    seeds = torch.arange(rows, dtype=torch.long) + 40
    choice, logprob = draw(logits, temperature, greedy, seeds, 3)
    # sampled rows: log_softmax(logits / T) at the choice; greedy rows: argmax, and the T=1 log-prob
    expected_t = torch.log_softmax(logits / temperature, -1).gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprob[:3], expected_t[:3], atol=1e-5, rtol=0)
    assert choice[3:].tolist() == logits[3:].argmax(-1).tolist()
    expected_1 = torch.log_softmax(logits, -1).gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprob[3:], expected_1[3:], atol=1e-5, rtol=0)
    # with truncation: log_softmax of the filtered distribution, and only kept tokens are drawn
    top_k, top_p = [5, 0, 50, 2, 0], torch.tensor([[1.0], [0.3], [0.9], [1.0], [0.5]])
    choice, logprob = draw(logits, temperature, greedy, seeds, 3, top_k, top_p)
    filtered = filter_logits(logits / temperature, top_k, top_p)
    expected = torch.log_softmax(filtered, -1).gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    assert bool(torch.isfinite(expected[:3]).all())
    torch.testing.assert_close(logprob[:3], expected[:3], atol=1e-5, rtol=0)
    # greedy rows ignore truncation
    assert choice[3:].tolist() == logits[3:].argmax(-1).tolist()
    torch.testing.assert_close(logprob[3:], expected_1[3:], atol=1e-5, rtol=0)


def test_draw_in_one_vocabulary_pass_equals_the_two_level_draw_over_full_weights():
    """``draw`` reads the vocabulary once (``row_stats``) and then only the chosen block; the draw before that
    change exponentiated the whole tempered vocabulary and ran ``sample_blocked`` over it. Same ids, same log-probs,
    for float32 and bfloat16 logits, vocabularies that are and are not whole blocks, sampled and greedy rows."""
    from ctxrl.engine.sampling import SAMPLE_BLOCK, draw, row_stats, sample_blocked

    def full_weights_draw(logits, temperature, greedy, seeds, step):
        target = torch.div(logits, temperature.float())
        top, best = target.max(-1, keepdim=True)
        weights = (target - top).exp_()
        choice, total = sample_blocked(weights, uniforms(seeds, step), with_total=True)
        choice = torch.where(greedy, best.squeeze(-1), choice)
        logprob = target.gather(-1, choice.unsqueeze(-1)).squeeze(-1) - top.squeeze(-1) - total.log().float()
        return choice, logprob

    g = torch.Generator().manual_seed(9)
    for vocab, dtype in [(3 * SAMPLE_BLOCK, torch.float32), (2500, torch.float32), (5000, torch.bfloat16)]:
        rows = 16
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        temperature = torch.rand(rows, 1, generator=g) + 0.3
        greedy = torch.rand(rows, generator=g) < 0.25
        temperature[greedy] = 1.0
        seeds = torch.randint(0, 1 << 40, (rows,), generator=g)
        for step in (0, 7, torch.arange(rows)):
            want = full_weights_draw(logits, temperature, greedy, seeds, step)
            got = draw(logits, temperature, greedy, seeds, step)
            assert torch.equal(got[0], want[0]), (vocab, dtype, step)
            torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=0)
    # the block sums add up to the softmax's normaliser; padding past the vocabulary adds nothing
    logits = torch.randn(3, 2500, generator=g)
    top, best, sums = row_stats(logits, torch.ones(3, 1), SAMPLE_BLOCK)
    assert sums.shape == (3, 3) and torch.equal(best, logits.argmax(-1))
    torch.testing.assert_close(top.squeeze(-1) + sums.sum(-1).log().float(), torch.logsumexp(logits, -1))


def test_the_compiled_sampler_draws_what_the_eager_one_draws():
    """On CUDA ``draw`` runs everything after the filter as one compiled graph (``_draw_core``). Compiled here on
    the CPU (the same inductor lowering of the same graph), it gives the eager form's ids and log-probs for new
    row counts (a compiled graph serves every batch size), bfloat16 logits, and an integer or per-row step."""
    from ctxrl.engine import sampling
    from ctxrl.models.fused import guarded_compile

    failures: list[str] = []
    compiled = guarded_compile(sampling._draw_core, "test sampler", on_failure=lambda: failures.append("x"))
    g = torch.Generator().manual_seed(4)
    for rows, vocab, dtype in [(16, 2500, torch.float32), (33, 3000, torch.bfloat16)]:
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        temperature = torch.rand(rows, 1, generator=g) + 0.3
        greedy = torch.rand(rows, generator=g) < 0.25
        seeds = torch.randint(0, 1 << 40, (rows,), generator=g)
        for step in (torch.full((rows,), 3), torch.arange(rows)):
            want = sampling._draw_core(logits, temperature, greedy, seeds, step)
            got = compiled(logits, temperature, greedy, seeds, step)
            assert torch.equal(got[0], want[0]), (rows, vocab, dtype)
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    assert not failures, "the sampler did not compile: the CUDA path would run it eagerly"
