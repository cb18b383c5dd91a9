"""One GRPO step on one GPU, piece by piece: decoding, agentic rollouts, the learner update, and the whole step vs TRL.

Every figure comes from a random-init model of a real checkpoint's shape (``ctxrl.models.shapes``,
``--model qwen2.5-0.5b`` by default: the shape sets speed and memory, the weights do not; nothing is
downloaded). Each arm runs in its own process (``sys.executable``, the environment and ``PYTHONPATH``
inherited), so one that fails or runs out of memory is reported as such and the next starts clean.
Four sections, chosen with ``--sections``:

1. **decode**: ``--batches`` rows (64/256/512) of ``--prompt-tokens`` (128) random ids, ``--new-tokens``
   (256) new tokens each, sampling at T=1 with no stop, so every row makes exactly that many. Arms:
   HF ``model.generate`` (eager, ``DynamicCache``), HF ``generate`` with ``cache_implementation="static"``
   and a ``CompileConfig`` (torch.compile; a failure is reported as the arm's result), ``HFEngine``,
   ``FastEngine`` (``ctxrl.engine.fast``). One warm-up run (its time is reported as ``first_s``), then
   the median of ``--repeats``. Reported: tokens/s, ms per decode step (the whole call over the new
   tokens, prefill included) and the HBM floor of a step: the bytes it must read, parameters plus the
   KV cache at the average context (``2 * layers * kv_heads * head_dim * dtype bytes * (prompt +
   new/2) * batch``), over a device-to-device copy bandwidth measured in the same process (a 1 GiB
   copy, median of 10, ``2 * bytes / time``); ``floor %`` is floor time over measured time. For the
   engines, the behaviour log-probs they report against the learner's
   (``ctxrl.learner.logprobs.token_logprobs``) on the sampled ids: mean, p99 and max of ``|diff|`` over
   tokens; for FastEngine also its compile / graph-capture seconds (``engine.stats["capture_seconds"]``).
2. **agentic**: ``--tasks`` (64) tasks x ``--samples`` (8) episodes of ``--turns`` (4) turns, all
   concurrent (``asyncio.gather``) on one engine. Turn 1's prompt is the task's ``--task-tokens`` (128)
   random ids, shared by its samples; each turn samples up to ``--turn-tokens`` (64) ids (no stop),
   then waits ``--tool-latency`` (0.05 s, a simulated tool) and the next prompt is the last prompt +
   the sampled ids + a ``--obs-tokens`` (100) id observation (random, seeded per episode). Reported:
   episodes/s, generated tokens/s, the prompt tokens asked for, and from the engine's stats the
   prefill tokens and the reused tokens (prompt tokens whose KV cache was reused). HFEngine vs FastEngine.
3. **learner**: one ctxrl PPO update (``ctxrl.learner.learner``) over ``--learner-seqs`` (64) sequences of
   ``--learner-tokens`` (1024) tokens (the first quarter prompt), bf16 weights with float32 master
   weights and AdamW state, chunked log-probs, micro-batches of ``--learner-max-tokens`` tokens; one
   warm-up update (it creates the optimiser state), then the median of ``--learner-updates``. Reported:
   tokens/s and MFU against 989 TFLOP/s (H100 SXM dense bf16) and against a bf16 8192^3 matmul timed in
   the same process. Arms: ``padded`` (HF's forward pass on right-padded rows), ``flat`` (the sequences laid
   end to end through ``ctxrl.learner.flat``, ``train.flat_forward = on``; it also reports how far its
   log-probs are from the HF pass's on the same tokens); ``--packed`` adds HF's forward pass on packed rows
   with a block-diagonal mask (``train.pack_sequences``).
4. **grpo**: the whole step, ``--prompts`` (64) prompts x ``--generations`` (8) completions of
   ``--prompt-tokens`` ids and up to ``--completion-tokens`` (256) new ones (the ``fixed`` variant) or a
   budget per completion drawn uniformly in ``--ragged-range`` (64,1024; seeded; the ``ragged`` variant).
   Arms: ``ctxrl`` (FastEngine generation of the 512 completions, group-normalised random rewards, one
   learner update over them, the new weights copied into the engine: seconds split into generation /
   update / sync) and TRL's ``GRPOTrainer`` (transformers generation path, no vLLM; random-float rewards;
   64 prompts of random ids as text through a word-level tokenizer whose token ``t<i>`` is id ``i``, so
   text and ids round-trip exactly, offline): ``trl_default`` (its defaults: float32 weights under bf16
   autocast, gradient checkpointing), ``trl_bf16_nockpt`` (bf16 weights, no checkpointing),
   ``trl_paged`` (the same plus ``use_transformers_continuous_batching=True``, the field that replaced
   ``use_transformers_paged`` in TRL 1.x). One optimiser step takes the 512 completions of one
   generation: ``per_device_train_batch_size`` rows a micro-batch (the most whose padded tokens fit
   ``--trl-max-tokens``, 8192 as ctxrl's micro-batches, or ``--trl-ckpt-max-tokens`` with checkpointing;
   ``--trl-micro-batch`` overrides) and gradient accumulation over the rest. One warm-up step, then
   ``--grpo-steps`` timed steps (a ``TrainerCallback`` with ``torch.cuda.synchronize``; generation
   seconds from a synchronised timer around TRL's ``_generate_single_turn``). The ragged variant
   (``--ragged-arms``) forces TRL's end-of-sequence token at each row's budget (a logits processor on
   ``model.generate``; the continuous-batching path cannot take one), so TRL pays for raggedness as it
   would on real completions. Peak GiB is ``torch.cuda.max_memory_allocated``
   (reset per arm). Before timing, each TRL arm checks that TRL's per-token log-probs
   (``_get_per_token_logps_and_entropies``) and ctxrl's ``token_logprobs`` agree on the same ids (max
   ``|diff|``, plain and under TRL's autocast).

MFU: FLOPs of a sequence of ``T`` tokens = ``6 N T + 12 L d (T/2) T`` (``N``: parameters without the
embedding and the output head; ``L`` layers, ``d`` hidden size; ``12 L d`` per token per attended
position is attention's ``QK^T`` and ``AV`` forward and backward, and a causal token attends to ``T/2``
positions on average), summed over the batch's sequences (their real lengths) and divided by the
update's seconds. ``mfu_head`` also counts the output head, ``6 V d`` per scored token.

All figures are also written as JSON to ``benchmarks/results/grpo_step-<card>-<time>.json`` (``--out``)::

    python benchmarks/grpo_step.py                                   # everything, default sizes
    python benchmarks/grpo_step.py --sections decode --batches 64,512 --repeats 2
    python benchmarks/grpo_step.py --sections grpo --grpo-arms ctxrl,trl_bf16_nockpt --variants fixed
    python benchmarks/grpo_step.py --smoke                           # every arm tiny, on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file from anywhere, ctxrl installed or not
    sys.path.insert(0, str(ROOT))

SECTIONS = ("decode", "agentic", "learner", "grpo")
DECODE_ARMS = ("hf_eager", "hf_static_compile", "hfengine", "fastengine", "fastengine_unfused")
AGENTIC_ARMS = ("hfengine", "fastengine", "fastengine_unfused")
ENGINE_ARMS = ("hfengine", "fastengine", "fastengine_unfused")
"""``fastengine_unfused``: the fast engine without its joined products and rotary-and-write kernel
(``FastEngine(fuse=False)``), the baseline for them; not run unless asked for."""
LEARNER_ARMS = ("padded", "packed", "flat", "flat_compiled", "flat_graphed")
GRPO_ARMS = ("ctxrl", "trl_default", "trl_bf16_nockpt", "trl_paged")
VARIANTS = ("fixed", "ragged")
PEAK_BF16 = 989e12  # H100 SXM, dense bf16
PAD, EOS = 0, 1  # the shapes' pad and eos ids; prompts draw from [3, vocab)


# -- shared helpers ------------------------------------------------------------------------------------
def fast_engine_error() -> str | None:
    """None if ``ctxrl.engine.fast.FastEngine`` imports, else why not."""
    try:
        from ctxrl.engine.fast import FastEngine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"FastEngine not importable: {type(exc).__name__}: {exc}"
    return None


def trl_error() -> str | None:
    try:
        import trl  # noqa: F401
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"TRL not importable: {type(exc).__name__}: {exc}"
    return None


def engine_class(name: str):
    if name.startswith("fastengine"):
        from ctxrl.engine.fast import FastEngine

        return functools.partial(FastEngine, fuse=name != "fastengine_unfused")
    from ctxrl.engine.hf import HFEngine

    return HFEngine


def env(args):
    """(torch, device, dtype, cuda)."""
    import torch

    return torch, args.device, getattr(torch, args.dtype), args.device.startswith("cuda")


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def random_ids(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def shape_info(model) -> dict:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen, total, param_bytes = set(), 0, 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
            param_bytes += p.numel() * p.element_size()
    non_embedding = total - embed.numel() - (0 if head.data_ptr() == embed.data_ptr() else head.numel())
    return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "kv_heads": c.num_key_value_heads,
            "head_dim": head_dim, "vocab": c.vocab_size, "params": total, "non_embedding_params": non_embedding,
            "param_bytes": param_bytes, "dtype_bytes": embed.element_size()}


def train_flops(info: dict, lengths: list[int], scored: int) -> tuple[float, float]:
    """(FLOPs without the head, FLOPs with it) of a forward and backward pass over sequences of ``lengths``."""
    n, layers, d = info["non_embedding_params"], info["layers"], info["hidden"]
    body = sum(6 * n * t + 12 * layers * d * (t / 2) * t for t in lengths)
    return body, body + 6 * info["vocab"] * d * scored


def copy_bandwidth(cuda: bool, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 10 copies."""
    import torch

    device = "cuda" if cuda else "cpu"
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(10):
        sync(cuda)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(cuda)
        times.append(time.perf_counter() - t0)
    del x, y
    return 2 * nbytes / statistics.median(times)


def matmul_flops(cuda: bool, n: int) -> float:
    """Achieved FLOP/s of an n^3 matmul in bf16 (float32 on the CPU), median of 10."""
    import torch

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        sync(cuda)
        t0 = time.perf_counter()
        a @ b
        sync(cuda)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def peak_gib(cuda: bool) -> float:
    if not cuda:
        return 0.0
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def reset_peak(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def generate_all(engine, prompts: list[list[int]], budgets: list[int], seed: int):
    from ctxrl.engine.base import SamplingParams

    async def go():
        return await asyncio.gather(*(
            engine.generate(p, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=b, seed=seed + i))
            for i, (p, b) in enumerate(zip(prompts, budgets))))
    return asyncio.run(go())


def logprob_mismatch(model, prompts, completions, rows: int, cuda: bool) -> dict:
    """|engine log-prob - learner log-prob| over the sampled tokens of the first ``rows`` rows."""
    import torch

    from ctxrl.learner.logprobs import token_logprobs

    device = next(model.parameters()).device
    diffs = []
    pairs = list(zip(prompts, completions))[:rows]
    with torch.no_grad():
        for start in range(0, len(pairs), 16):
            part = pairs[start:start + 16]
            width = max(len(p) + len(c.token_ids) for p, c in part)
            ids = torch.full((len(part), width), PAD, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for r, (p, c) in enumerate(part):
                seq = p + c.token_ids
                ids[r, :len(seq)] = torch.tensor(seq)
                attn[r, :len(seq)] = 1
            ids, attn = ids.to(device), attn.to(device)
            lp = token_logprobs(model.eval(), ids, attn, chunk=1024).float().cpu()
            for r, (p, c) in enumerate(part):
                n = len(c.token_ids)
                if n:
                    diffs.append((lp[r, len(p) - 1:len(p) - 1 + n] - torch.tensor(c.logprobs)).abs())
    if not diffs:
        return {}
    d = torch.cat(diffs)
    return {"lp_mean": float(d.mean()), "lp_p99": float(torch.quantile(d, 0.99)) if d.numel() > 1 else float(d[0]),
            "lp_max": float(d.max()), "lp_tokens": int(d.numel())}


def numeric_delta(after: dict, before: dict) -> dict:
    return {k: round(v - before.get(k, 0), 4) if isinstance(v, float) else v - before.get(k, 0)
            for k, v in after.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


# -- 1. decode -----------------------------------------------------------------------------------------
def decode_arm(args, arm: str) -> dict:
    torch, device, dtype, cuda = env(args)
    from ctxrl.models.shapes import random_model

    model = random_model(args.model, dtype, device).eval()
    info = shape_info(model)
    bandwidth = copy_bandwidth(cuda, args.copy_bytes)
    vocab, P, N = info["vocab"], args.prompt_tokens, args.new_tokens
    out = {"arm": arm, "bandwidth_gbs": round(bandwidth / 1e9, 1), "rows": []}
    engine = None
    if arm in ENGINE_ARMS:
        engine = engine_class(arm)(model, pad_token_id=PAD, max_batch_size=max(args.batches), seed=0,
                                   max_total_tokens=P + N + 8)

    def run(prompts, seed):
        if engine is not None:
            done = generate_all(engine, prompts, [N] * len(prompts), seed)
            assert all(len(c.token_ids) == N for c in done), "an engine row stopped before --new-tokens"
            return done
        ids = torch.tensor(prompts, device=device)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                      temperature=1.0, max_new_tokens=N, min_new_tokens=N, pad_token_id=PAD)
        if arm == "hf_static_compile":
            from transformers import CompileConfig

            kwargs.update(cache_implementation="static", compile_config=CompileConfig())
        with torch.no_grad():
            result = model.generate(**kwargs)
        assert result.shape[1] == P + N, f"generate made {result.shape[1] - P} tokens, not {N}"
        return None

    for bs in args.batches:
        sets = [random_ids(vocab, bs, P, seed=1000 * bs + r) for r in range(args.repeats + 1)]
        kv_bytes = 2 * info["layers"] * info["kv_heads"] * info["head_dim"] * info["dtype_bytes"] * (P + N / 2) * bs
        floor_ms = (info["param_bytes"] + kv_bytes) / bandwidth * 1e3
        row = {"batch": bs, "floor_ms_per_step": round(floor_ms, 3), "floor_tok_s": round(bs / floor_ms * 1e3)}
        try:
            t0 = time.perf_counter()
            run(sets[0], seed=0)
            sync(cuda)
            row["first_s"] = round(time.perf_counter() - t0, 2)
            times, last = [], None
            for r, prompts in enumerate(sets[1:]):
                sync(cuda)
                t0 = time.perf_counter()
                last = run(prompts, seed=100_000 * (r + 1))
                sync(cuda)
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            ms = t / N * 1e3
            row.update(seconds=round(t, 3), tok_s=round(bs * N / t), ms_per_step=round(ms, 3),
                       floor_frac=round(floor_ms / ms, 3))
            if last is not None:
                row.update(logprob_mismatch(model, sets[-1], last, args.mismatch_rows, cuda))
            if getattr(args, "profile", False):
                row.update(profile_call(functools.partial(run, sets[-1], seed=7), cuda))
        except Exception as exc:  # noqa: BLE001 - the arm's result, e.g. torch.compile failing
            row["error"] = short(exc)
        out["rows"].append(row)
        print(f"  decode {arm} batch {bs}: {row}", file=sys.stderr, flush=True)
    if engine is not None:
        out["engine_stats"] = {k: v for k, v in engine.stats.items() if isinstance(v, (int, float, str))}
        out["capture_seconds"] = engine.stats.get("capture_seconds")
        engine.close()
    out["peak_gib"] = peak_gib(cuda)
    return out


# -- 2. agentic ----------------------------------------------------------------------------------------
async def episode(engine, task_prompt: list[int], seed: int, args, vocab: int) -> tuple[int, int]:
    from ctxrl.engine.base import SamplingParams

    observations = random_ids(vocab, args.turns, args.obs_tokens, seed=seed)
    prompt, asked, made = list(task_prompt), 0, 0
    for turn in range(args.turns):
        c = await engine.generate(prompt, SamplingParams(temperature=1.0, top_k=0, top_p=1.0,
                                                         max_new_tokens=args.turn_tokens, seed=seed * 64 + turn))
        asked += len(prompt)
        made += len(c.token_ids)
        if turn + 1 < args.turns:
            await asyncio.sleep(args.tool_latency)  # the tool call
            prompt = prompt + c.token_ids + observations[turn]
    return asked, made


def agentic_arm(args, arm: str) -> dict:
    torch, device, dtype, cuda = env(args)
    from ctxrl.models.shapes import random_model

    model = random_model(args.model, dtype, device).eval()
    vocab = model.config.vocab_size
    n = args.tasks * args.samples
    longest = args.task_tokens + (args.turns - 1) * (args.turn_tokens + args.obs_tokens) + args.turn_tokens
    engine = engine_class(arm)(model, pad_token_id=PAD, max_batch_size=n, seed=0, max_total_tokens=longest + 8)

    def play(seed: int):
        tasks = random_ids(vocab, args.tasks, args.task_tokens, seed=seed)

        async def go():
            return await asyncio.gather(*(episode(engine, tasks[i // args.samples], seed * 100_000 + i, args, vocab)
                                          for i in range(n)))
        return asyncio.run(go())

    out = {"arm": arm, "episodes": n, "turns": args.turns}
    t0 = time.perf_counter()
    play(seed=1)  # warm-up: the same shapes, other ids
    sync(cuda)
    out["first_s"] = round(time.perf_counter() - t0, 2)
    times, stats = [], []
    for r in range(max(1, args.agentic_repeats)):
        before = dict(engine.stats)
        sync(cuda)
        t0 = time.perf_counter()
        results = play(seed=2 + r)
        sync(cuda)
        times.append(time.perf_counter() - t0)
        stats.append(numeric_delta(engine.stats, before))
    t = statistics.median(times)
    if getattr(args, "profile", False):
        out.update(profile_call(lambda: play(seed=99), cuda))
        out["host_stacks"] = host_stacks(lambda: play(seed=98))
    asked = sum(a for a, _ in results)
    made = sum(m for _, m in results)
    last = stats[-1]
    out.update(seconds=round(t, 3), episodes_s=round(n / t, 2), gen_tok_s=round(made / t), generated_tokens=made,
               prompt_tokens=asked, prefill_tokens=last.get("prefill_tokens"), reused_tokens=last.get("reused_tokens"),
               engine_stats=last, capture_seconds=engine.stats.get("capture_seconds"), peak_gib=peak_gib(cuda))
    engine.close()
    return out


# -- 3. learner ----------------------------------------------------------------------------------------
def make_learner(args, model, precision, rows: int):
    import dataclasses

    from ctxrl.learner.learner import Learner, LearnerSettings
    from ctxrl.learner.policy import Policy
    from ctxrl.sections import TrainConfig

    policy = Policy(model, precision)
    train = TrainConfig(mini_batches=1, micro_batch_size=rows, logprob_chunk_tokens=args.chunk)
    flat_mode = getattr(args, "flat_mode", None)  # the learner arms say; the GRPO arm keeps ctxrl's default
    if flat_mode is not None:
        train = dataclasses.replace(train, flat_forward=flat_mode)
    if getattr(args, "packed_arm", False):
        train = dataclasses.replace(train, pack_sequences=True)
    settings = LearnerSettings(train=train, micro_batch_tokens=args.learner_max_tokens)
    learner = Learner(model, precision.optimizer(policy.trainable_parameters(), lr=1e-6), settings, pad_token_id=PAD,
                      precision=precision)
    return policy, learner


def make_precision(args, cuda: bool):
    from ctxrl.learner.precision import Precision

    return Precision(args.dtype if cuda else "float32", "float32", args.device)


def episodes(prompts, completions, logprobs, advantages):
    from ctxrl.learner.batch import collate
    from ctxrl.types import Episode, Task

    rows = [Episode(task=Task(id=str(i), prompt="p", answer="a"), input_ids=p + c,
                    loss_mask=[0] * len(p) + [1] * len(c), behavior_logprobs=[0.0] * len(p) + list(lp),
                    turn_index=[0] * (len(p) + len(c)))
            for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs))]
    return collate(rows, PAD, advantages=advantages)


def learner_arm(args, arm: str) -> dict:
    torch, device, dtype, cuda = env(args)
    from ctxrl.models.shapes import random_model

    args.packed_arm = arm == "packed"
    args.flat_mode = {"flat": "on", "flat_compiled": "compiled", "flat_graphed": "graphed"}.get(arm, "off")
    precision = make_precision(args, cuda)
    model = random_model(args.model, precision.storage, device)
    info = shape_info(model)
    _, learner = make_learner(args, model, precision, args.learner_seqs)
    S, T = args.learner_seqs, args.learner_tokens
    prompt = T // 4
    ids = random_ids(info["vocab"], S, T, seed=0)
    g = torch.Generator().manual_seed(1)
    behaviour = (-torch.rand(S, T - prompt, generator=g) * 4).tolist()
    data = episodes([r[:prompt] for r in ids], [r[prompt:] for r in ids], behaviour,
                    [1.0 if i % 2 else -1.0 for i in range(S)])
    agreement = flat_agreement(learner, model, data, cuda) if arm.startswith("flat") else {}
    if arm == "flat_graphed":
        agreement.update(graph_agreement(learner, model, data))
    reset_peak(cuda)
    times = []
    for _ in range(max(1, args.learner_updates) + 1):
        sync(cuda)
        t0 = time.perf_counter()
        metrics = learner.update(data)
        sync(cuda)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[1:])
    profile = profile_update(learner, data, cuda) if getattr(args, "profile", False) else {}
    body, with_head = train_flops(info, [T] * S, S * (T - prompt))
    peak_mm = matmul_flops(cuda, args.matmul_size)
    return {"arm": arm, "seqs": S, "tokens": T, "first_s": round(times[0], 2), "seconds": round(t, 3),
            "tok_s": round(S * T / t), "tflops": round(body / t / 1e12, 1), "mfu": round(body / t / PEAK_BF16, 4),
            "mfu_head": round(with_head / t / PEAK_BF16, 4), "matmul_tflops": round(peak_mm / 1e12, 1),
            "mfu_vs_matmul": round(body / t / peak_mm, 4), "loss": metrics.get("loss"),
            "peak_gib": peak_gib(cuda), "non_embedding_params": info["non_embedding_params"], **agreement, **profile}


def profile_update(learner, data, cuda: bool, top: int = 12) -> dict:
    """One more update under ``torch.profiler`` (``profile_call``)."""
    return profile_call(lambda: learner.update(data), cuda, top)


def profile_call(fn, cuda: bool, top: int = 30) -> dict:
    """``fn()`` once more under ``torch.profiler``: its wall time, the device's busy time (the sum of its kernels'
    times: below the wall time by what the host and the waits cost), that time by kind of kernel, the busiest
    kernels, and how many kernels were launched."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        sync(cuda)
        t0 = time.perf_counter()
        fn()
        sync(cuda)
        wall = time.perf_counter() - t0
    from torch.autograd import DeviceType

    # kernels only (an operator's entry also carries its kernels' time)
    events = [e for e in prof.key_averages() if (e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
                                                  if cuda else e.self_cpu_time_total > 0)]
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    busy = sum(key(e) for e in events) / 1e6

    def kind(name: str) -> str:
        low = name.lower()
        if any(w in low for w in ("gemm", "matmul", "cutlass", "nvjet", "xmma", "aten::mm", "addmm", "bmm")):
            return "matmul"
        if "flash" in low or "attention" in low or "fmha" in low:
            return "attention"
        if "triton" in low:
            return "compiled (triton)"
        if "memcpy" in low or "memset" in low:
            return "copies"
        return "other"

    kinds: dict[str, float] = {}
    for e in events:
        kinds[kind(e.key)] = kinds.get(kind(e.key), 0.0) + key(e) / 1e6
    busiest = sorted(events, key=key, reverse=True)[:top]
    return {"profile_wall_s": round(wall, 3), "profile_busy_s": round(busy, 3),
            "profile_busy_frac": round(busy / wall, 3) if wall > 0 else None,
            "profile_kernels": int(sum(e.count for e in events)),
            "profile_by_kind_s": {k: round(v, 3) for k, v in kinds.items()},
            "profile_top": [[e.key[:80], round(key(e) / 1e6, 4), e.count] for e in busiest]}


def host_stacks(fn, interval: float = 0.0005, top: int = 12) -> dict:
    """``fn()`` once more while a sampler thread reads every thread's Python stack each ``interval`` seconds
    (``sys._current_frames``): per thread, the share of samples in each innermost frame, in each innermost
    frame inside ``ctxrl`` (what of ctxrl's own code the thread was running or waiting in), and the commonest
    stacks (their ten innermost frames). The host-side
    counterpart of ``profile_call``: where an engine's worker thread and the event loop spend their wall time,
    waits included (a thread blocked in a device sync shows the line that waits)."""
    import threading
    from collections import Counter

    import ctxrl

    package = os.path.dirname(ctxrl.__file__) + os.sep
    stop = threading.Event()
    leaf: dict[str, Counter] = {}
    own: dict[str, Counter] = {}
    chains: dict[str, Counter] = {}
    totals: Counter = Counter()

    def where(frame) -> str:
        code = frame.f_code
        path = code.co_filename
        name = "ctxrl/" + path[len(package):] if path.startswith(package) else Path(path).name
        return f"{name}:{code.co_name}:{frame.f_lineno}"

    def sample():
        while not stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():  # the sampler itself
                    continue
                name = names.get(ident, str(ident))
                totals[name] += 1
                leaf.setdefault(name, Counter())[where(frame)] += 1
                f = frame
                while f is not None and not f.f_code.co_filename.startswith(package):
                    f = f.f_back
                own.setdefault(name, Counter())[where(f) if f is not None else "(outside ctxrl)"] += 1
                chain, g = [], frame
                while g is not None and len(chain) < 10:
                    chain.append(where(g))
                    g = g.f_back
                chains.setdefault(name, Counter())[" < ".join(chain)] += 1
            time.sleep(interval)

    sampler = threading.Thread(target=sample, name="stack-sampler", daemon=True)
    t0 = time.perf_counter()
    sampler.start()
    try:
        fn()
    finally:
        stop.set()
        sampler.join()
    wall = time.perf_counter() - t0

    def shares(counter: Counter, n: int) -> list:
        return [[k, round(v / n, 3)] for k, v in counter.most_common(top)]

    return {"wall_s": round(wall, 3), "threads": {name: {"samples": n, "leaf": shares(leaf[name], n),
                                                          "ctxrl": shares(own[name], n),
                                                          "stacks": [[k, round(v / n, 3)]
                                                                     for k, v in chains[name].most_common(8)]}
                                                   for name, n in totals.most_common() if n >= 10}}


def with_flat_forward(settings, mode: str):
    """``settings`` (a ``LearnerSettings``) with ``train.flat_forward = mode``."""
    import dataclasses

    return dataclasses.replace(settings, train=dataclasses.replace(settings.train, flat_forward=mode))


def flat_agreement(learner, model, data, cuda: bool) -> dict:
    """|flat - HF| log-probs of the first 4 sequences' sampled tokens (no gradient): the two forward passes agree."""
    import torch

    from ctxrl.learner.batch import micro_batches

    _, micro = next(micro_batches(data.select(list(range(min(4, len(data))))), 4, learner.device))
    with torch.no_grad():
        flat = learner.settings.logprobs(model, micro)
        hf = with_flat_forward(learner.settings, "off").logprobs(model, micro)
    delta = ((flat - hf).abs() * micro.loss_mask)[micro.loss_mask.bool()].float()
    return {"flat_vs_hf_logprob_mean": round(float(delta.mean()), 5),
            "flat_vs_hf_logprob_max": round(float(delta.max()), 5)}


def graph_agreement(learner, model, data) -> dict:
    """One micro-batch's log-probs and every weight's gradient through the layers' CUDA graphs against the eager
    flat pass (``train.flat_forward`` graphed vs on), relative to the largest gradient; and the captures made."""
    import torch

    from ctxrl.learner.batch import micro_batches
    from ctxrl.learner.flat import training_decoder

    _, micro = next(micro_batches(data, len(data), learner.device, learner.settings.micro_batch_tokens,
                                  padded=False))
    # (with float32 masters the gradients land in the optimiser's masters, and the model's own are let go)
    params = [p for group in learner.optimizer.param_groups for p in group["params"]]
    out = []
    for mode in ("graphed", "on"):
        learner.optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        lp = with_flat_forward(learner.settings, mode).logprobs(model, micro)
        (lp * micro.loss_mask).sum().backward()
        grads = [p.grad for p in (*model.parameters(), *params) if p.grad is not None]
        out.append((lp.detach().double(), torch.cat([g.double().flatten() for g in grads])))
    learner.optimizer.zero_grad(set_to_none=True)
    (lp_g, g_g), (lp_e, g_e) = out
    mask = micro.loss_mask.bool()
    graphs = training_decoder(model, "graphed").graphs
    return {"graph_vs_eager_logprob_max": round(float((lp_g - lp_e).abs()[mask].max()), 5),
            "graph_vs_eager_grad_rel": round(float((g_g - g_e).abs().max() / g_e.abs().max()), 5),
            "graph_vs_eager_grad_cos": round(float(torch.nn.functional.cosine_similarity(g_g, g_e, dim=0)), 6),
            "graph_bucket": None if graphs is None else str(graphs.bucket), "graph_captures": 0 if graphs is None
            else graphs.captures}


# -- 4. grpo -------------------------------------------------------------------------------------------
def budgets_for(args, variant: str, step: int) -> list[int]:
    import torch

    n = args.prompts * args.generations
    if variant == "fixed":
        return [args.completion_tokens] * n
    lo, hi = args.ragged_range
    return torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(10_000 + step)).tolist()


def group_advantages(rewards: list[float], group: int) -> list[float]:
    out = []
    for start in range(0, len(rewards), group):
        r = rewards[start:start + group]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / max(len(r) - 1, 1))
        out += [(x - mean) / (std + 1e-4) for x in r]
    return out


def ctxrl_grpo_arm(args, variant: str) -> dict:
    torch, device, dtype, cuda = env(args)
    from ctxrl.models.shapes import random_model

    engine_name = args.ctxrl_engine
    note = None
    if engine_name == "fastengine" and args.smoke and fast_engine_error():
        engine_name, note = "hfengine", "FastEngine not importable: smoke run on HFEngine"
    precision = make_precision(args, cuda)
    model = random_model(args.model, precision.storage, device)
    info = shape_info(model)
    policy, learner = make_learner(args, model, precision, args.prompts * args.generations)
    hi = args.completion_tokens if variant == "fixed" else args.ragged_range[1]
    engine = engine_class(engine_name)(policy.engine_model(), pad_token_id=PAD, seed=0,
                                       max_batch_size=args.prompts * args.generations,
                                       max_total_tokens=args.prompt_tokens + hi + 8)
    prompts = [p for p in random_ids(info["vocab"], args.prompts, args.prompt_tokens, seed=0)
               for _ in range(args.generations)]
    rng = torch.Generator().manual_seed(2)
    reset_peak(cuda)
    steps = []
    for step in range(args.grpo_warmup + args.grpo_steps):
        sync(cuda)
        t0 = time.perf_counter()
        done = generate_all(engine, prompts, budgets_for(args, variant, step), seed=step * 1_000_000)
        sync(cuda)
        t1 = time.perf_counter()
        advantages = group_advantages(torch.rand(len(done), generator=rng).tolist(), args.generations)
        batch = episodes(prompts, [c.token_ids for c in done], [c.logprobs for c in done], advantages)
        learner.update(batch)
        sync(cuda)
        t2 = time.perf_counter()
        state, partial = policy.engine_state()
        engine.load_weights(state, version=step + 1, **({"partial": True} if partial else {}))
        sync(cuda)
        t3 = time.perf_counter()
        lengths = [len(p) + len(c.token_ids) for p, c in zip(prompts, done)]
        steps.append({"gen_s": t1 - t0, "update_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0,
                      "completion_tokens": sum(len(c.token_ids) for c in done), "lengths": lengths})
    timed = steps[args.grpo_warmup:]
    out = summarise_steps(timed, info)
    out.update(arm="ctxrl", variant=variant, engine=engine_name, first_s=round(steps[0]["step_s"], 2),
               peak_gib=peak_gib(cuda), capture_seconds=engine.stats.get("capture_seconds"),
               engine_stats={k: v for k, v in engine.stats.items() if isinstance(v, (int, float))})
    if note:
        out["note"] = note
    engine.close()
    return out


def summarise_steps(timed: list[dict], info: dict) -> dict:
    med = {k: statistics.median(s[k] for s in timed) for k in ("gen_s", "update_s", "sync_s", "step_s")}
    completion = statistics.median(s["completion_tokens"] for s in timed)
    out = {k: round(v, 3) for k, v in med.items()}
    out.update(steps=len(timed), completion_tokens=int(completion),
               gen_tok_s=round(completion / med["gen_s"]) if med["gen_s"] else None)
    if med["update_s"]:
        body, with_head = train_flops(info, timed[-1]["lengths"], timed[-1]["completion_tokens"])
        out.update(update_tok_s=round(sum(timed[-1]["lengths"]) / med["update_s"]),
                   update_mfu=round(body / med["update_s"] / PEAK_BF16, 4),
                   update_mfu_head=round(with_head / med["update_s"] / PEAK_BF16, 4))
    return out


def word_tokenizer(vocab: int):
    """A word-level tokenizer whose token ``t<i>`` is id ``i`` (0 pad, 1 eos, 2 unk): ids -> text -> ids exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<eos>": EOS, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")


def force_lengths(model, budgets_of_call):
    """Make ``model.generate`` end row ``i`` (EOS) after ``budgets_of_call(rows)[i]`` tokens: ragged completions."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class ForceEos(LogitsProcessor):
        def __init__(self, budgets: torch.Tensor) -> None:
            self.budgets, self.start = budgets, None

        def __call__(self, input_ids, scores):
            if self.start is None:
                self.start = input_ids.shape[1]
            made = input_ids.shape[1] - self.start
            end = (self.budgets.to(scores.device) == made + 1).unsqueeze(-1)
            forced = torch.full_like(scores, -math.inf)
            forced[:, EOS] = 0.0
            return torch.where(end, forced, scores)

    original = model.generate

    def generate(*a, **kw):
        rows = (kw.get("input_ids") if kw.get("input_ids") is not None else a[0]).shape[0]
        processors = LogitsProcessorList(kw.pop("logits_processor", None) or [])
        processors.append(ForceEos(torch.tensor(budgets_of_call(rows))))
        return original(*a, logits_processor=processors, **kw)

    model.generate = generate


def trl_grpo_arm(args, arm: str, variant: str) -> dict:
    torch, device, dtype, cuda = env(args)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ctxrl.learner.logprobs import token_logprobs
    from ctxrl.models.shapes import random_model

    if arm == "trl_paged" and variant == "ragged":
        raise SystemExit("ragged budgets are forced through model.generate's logits processors; "
                         "TRL's continuous-batching path (generate_batch) is not patched: skipped")
    weights = torch.float32 if arm == "trl_default" or not cuda else dtype
    model = random_model(args.model, weights, device)
    info = shape_info(model)
    tokenizer = word_tokenizer(info["vocab"])
    prompt_ids = random_ids(info["vocab"], args.prompts, args.prompt_tokens, seed=0)
    dataset = Dataset.from_dict({"prompt": [tokenizer.decode(p) for p in prompt_ids]})
    n = args.prompts * args.generations
    hi = args.completion_tokens if variant == "fixed" else args.ragged_range[1]
    micro = trl_micro_batch(args, n, args.prompt_tokens + hi, checkpointing=arm == "trl_default")
    total_steps = args.grpo_warmup + args.grpo_steps

    def reward(completions, **_):
        return torch.rand(len(completions)).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(output_dir=tmp, per_device_train_batch_size=micro, gradient_accumulation_steps=n // micro,
                            num_generations=args.generations, max_completion_length=hi, max_steps=total_steps,
                            learning_rate=1e-6, temperature=1.0, top_k=0, top_p=1.0, logging_steps=1,
                            save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                            dataloader_num_workers=0, bf16=cuda, use_cpu=not cuda,
                            gradient_checkpointing=arm == "trl_default",
                            use_transformers_continuous_batching=arm == "trl_paged")
        clock = {"marks": [], "gen": [0.0]}

        class Timer(TrainerCallback):
            def on_train_begin(self, *a, **kw):
                reset_peak(cuda)
                clock["marks"].append(time.perf_counter())

            def on_step_end(self, *a, **kw):
                sync(cuda)
                clock["marks"].append(time.perf_counter())
                clock["gen"].append(0.0)

        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Timer()])
        generate_turn = trainer._generate_single_turn

        def timed_generation(*a, **kw):
            sync(cuda)
            t0 = time.perf_counter()
            result = generate_turn(*a, **kw)
            sync(cuda)
            clock["gen"][-1] += time.perf_counter() - t0
            return result

        trainer._generate_single_turn = timed_generation
        if variant == "ragged":
            calls = iter(range(1 << 30))

            def budgets(rows: int) -> list[int]:  # one generation call = one step's completions
                drawn = budgets_for(args, variant, next(calls))
                return (drawn * (rows // len(drawn) + 1))[:rows]

            force_lengths(model, budgets)
        check = logprob_agreement(trainer, model, prompt_ids, info["vocab"], token_logprobs, device)
        trainer.train()
    marks = clock["marks"]
    steps = []
    for k in range(1, len(marks)):
        gen = clock["gen"][k - 1]
        steps.append({"step_s": marks[k] - marks[k - 1], "gen_s": gen, "update_s": marks[k] - marks[k - 1] - gen,
                      "sync_s": 0.0, "completion_tokens": 0, "lengths": []})
    timed = steps[args.grpo_warmup:] or steps
    out = {k: round(statistics.median(s[k] for s in timed), 3) for k in ("gen_s", "update_s", "step_s")}
    out.update(arm=arm, variant=variant, steps=len(timed), first_s=round(steps[0]["step_s"], 2) if steps else None,
               peak_gib=peak_gib(cuda), weights=str(weights).split(".")[-1], micro_batch=micro,
               trl=trl.__version__, transformers=transformers.__version__, **check)
    log = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    if log:
        mean_len = statistics.median(h["completions/mean_length"] for h in log[args.grpo_warmup:] or log)
        out["completion_tokens"] = round(mean_len * n)
        out["gen_tok_s"] = round(mean_len * n / out["gen_s"]) if out["gen_s"] else None
    return out


def trl_micro_batch(args, n: int, width: int, *, checkpointing: bool) -> int:
    """``--trl-micro-batch``, or the most rows (a divisor of ``n``) whose padded tokens fit the token budget."""
    if args.trl_micro_batch:
        return min(args.trl_micro_batch, n)
    budget = args.trl_ckpt_max_tokens if checkpointing else args.trl_max_tokens
    return max([d for d in range(1, n + 1) if n % d == 0 and d * width <= budget] or [1])


def logprob_agreement(trainer, model, prompt_ids, vocab, token_logprobs, device) -> dict:
    """TRL's per-token log-probs vs ctxrl's on the same ids (max |diff|), before any update."""
    import torch

    try:
        k = 32
        rows = prompt_ids[:4]
        completion = random_ids(vocab, len(rows), k, seed=7)
        ids = torch.tensor([p + c for p, c in zip(rows, completion)], device=device)
        attn = torch.ones_like(ids)
        fn = getattr(trainer, "_get_per_token_logps_and_entropies", None) or trainer._get_per_token_logps
        with torch.no_grad():
            theirs = fn(trainer.model, ids, attn, k)
            theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).float()
            ours = token_logprobs(model, ids, attn, chunk=1024)[:, -k:].float()
            with trainer.accelerator.autocast():
                ours_autocast = token_logprobs(model, ids, attn, chunk=1024)[:, -k:].float()
        return {"trl_vs_ctxrl_lp_max": float((theirs - ours).abs().max()), "trl_lp_mean": float(theirs.mean()),
                "trl_vs_ctxrl_autocast_lp_max": float((theirs - ours_autocast).abs().max())}
    except Exception as exc:  # noqa: BLE001 - a failed check is reported, the timing still runs
        return {"trl_vs_ctxrl_lp_error": short(exc)}


# -- running arms in their own processes ---------------------------------------------------------------
def child(args) -> dict:
    section, arm, variant = (args.one.split(":") + [""])[:3]
    if section == "decode":
        return decode_arm(args, arm)
    if section == "agentic":
        return agentic_arm(args, arm)
    if section == "learner":
        return learner_arm(args, arm)
    if arm == "ctxrl":
        return ctxrl_grpo_arm(args, variant)
    return trl_grpo_arm(args, arm, variant)


def run_one(spec: str, argv: list[str], args) -> dict:
    section, arm, variant = (spec.split(":") + [""])[:3]
    base = {"arm": arm, **({"variant": variant} if variant else {})}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), environment.get("PYTHONPATH")) if p)
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--one", spec, "--result-file", str(result)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=args.arm_timeout)
        except subprocess.TimeoutExpired:
            return {**base, "error": f"timed out after {args.arm_timeout} s"}
        wall = round(time.perf_counter() - t0, 1)
        print(f"[{spec}] {wall} s", file=sys.stderr, flush=True)
        if proc.returncode != 0 or not result.exists():
            text = proc.stderr.strip()
            oom = "OutOfMemoryError" in text or "out of memory" in text
            lines = [line for line in text.splitlines() if line.strip()]
            why = "out of memory" if oom else (lines[-1][:400] if lines else f"exit {proc.returncode}")
            return {**base, "error": why, "process_s": wall, "stderr_tail": lines[-40:]}
        return {**json.loads(result.read_text()), "process_s": wall}


def arms_of(args) -> list[tuple[str, str, str]]:
    """(section, arm, variant) in running order."""
    out = []
    for section in args.sections:
        if section == "decode":
            out += [("decode", a, "") for a in args.decode_arms]
        elif section == "agentic":
            out += [("agentic", a, "") for a in args.agentic_arms]
        elif section == "learner":
            arms = [a for a in LEARNER_ARMS if a != "packed" or args.packed]
            out += [("learner", a, "") for a in arms if a in args.learner_arms]
        else:
            out += [("grpo", a, v) for v in args.variants for a in args.grpo_arms
                    if v == "fixed" or a in args.ragged_arms]
    return out


def skip_reason(section: str, arm: str, args, checks: dict) -> str | None:
    if arm.startswith("fastengine") or (section == "grpo" and arm == "ctxrl" and args.ctxrl_engine == "fastengine"
                               and not args.smoke):
        return checks["fast"]
    if arm.startswith("trl"):
        return checks["trl"]
    return None


# -- tables --------------------------------------------------------------------------------------------
def fmt(v, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def _ready(rows: list[dict], key: str, width: int, with_variant: bool = False):
    """The rows that ran (they have ``key``); a skipped or failed one is printed as its reason instead."""
    for r in rows:
        if key in r:
            yield r
        else:
            variant = f"{r.get('variant', ''):7s} " if with_variant else ""
            print(f"{r['arm']:{width}s} {variant}{r.get('skipped') or r.get('error')}")


def print_tables(report: dict) -> None:
    sections = report["sections"]
    if "decode" in sections:
        print(f"\ndecode: prompt {report['args']['prompt_tokens']} + {report['args']['new_tokens']} new tokens, "
              f"T=1, no stop; median of {report['args']['repeats']} (floor: HBM bytes per step / copy bandwidth)")
        print(f"{'arm':18s} {'batch':>5s} {'tok/s':>8s} {'ms/step':>8s} {'floor ms':>8s} {'floor %':>7s} "
              f"{'first s':>7s} {'|dlp| mean':>10s} {'p99':>8s} {'max':>8s}")
        for r in sections["decode"]:
            if "rows" not in r:
                print(f"{r['arm']:18s} {r.get('skipped') or r.get('error')}")
                continue
            for row in r["rows"]:
                if "error" in row:
                    print(f"{r['arm']:18s} {row['batch']:5d} {row['error']}")
                    continue
                print(f"{r['arm']:18s} {row['batch']:5d} {row['tok_s']:8d} {row['ms_per_step']:8.2f} "
                      f"{row['floor_ms_per_step']:8.3f} {100 * row['floor_frac']:6.1f}% {row['first_s']:7.1f} "
                      f"{fmt(row.get('lp_mean'), '.2e'):>10s} {fmt(row.get('lp_p99'), '.2e'):>8s} "
                      f"{fmt(row.get('lp_max'), '.2e'):>8s}")
                print_profile(row, f"{'':18s} ")
            if r.get("capture_seconds") is not None:
                print(f"{'':18s} capture/compile seconds: {r['capture_seconds']}")
    if "agentic" in sections:
        print("\nagentic: concurrent multi-turn episodes on one engine")
        print(f"{'arm':12s} {'episodes':>8s} {'ep/s':>7s} {'gen tok/s':>9s} {'prompt tok':>10s} {'prefilled':>10s} "
              f"{'reused':>10s} {'seconds':>8s}")
        for r in _ready(sections["agentic"], "seconds", 12):
            print(f"{r['arm']:12s} {r['episodes']:8d} {r['episodes_s']:7.2f} {r['gen_tok_s']:9d} "
                  f"{r['prompt_tokens']:10d} {fmt(r.get('prefill_tokens')):>10s} "
                  f"{fmt(r.get('reused_tokens')):>10s} {r['seconds']:8.2f}")
            print_profile(r, f"{'':12s} ")
            print_stacks(r.get("host_stacks"), f"{'':12s} ")
        done = {r["arm"]: r for r in sections["agentic"] if "seconds" in r}
        if {"hfengine", "fastengine"} <= set(done):
            ratio = done["fastengine"]["episodes_s"] / done["hfengine"]["episodes_s"]
            print(f"FastEngine / HFEngine episodes/s: {ratio:.2f}")
    if "learner" in sections:
        print("\nlearner: one PPO update, bf16 weights + float32 masters; "
              "MFU = sum over sequences of (6 N T + 12 L d (T/2) T) / s / 989e12")
        print(f"{'arm':8s} {'batch':>9s} {'s':>7s} {'tok/s':>8s} {'TFLOP/s':>8s} {'MFU 989':>8s} {'+head':>7s} "
              f"{'matmul TF':>9s} {'MFU/mm':>7s} {'peak GiB':>8s}")
        for r in _ready(sections["learner"], "seconds", 8):
            print(f"{r['arm']:8s} {str(r['seqs']) + 'x' + str(r['tokens']):>9s} {r['seconds']:7.3f} {r['tok_s']:8d} "
                  f"{r['tflops']:8.1f} {100 * r['mfu']:7.1f}% {100 * r['mfu_head']:6.1f}% {r['matmul_tflops']:9.1f} "
                  f"{100 * r['mfu_vs_matmul']:6.1f}% {r['peak_gib']:8.2f}")
    if "grpo" in sections:
        print("\ngrpo: one step = generate the completions + one optimiser step over them; medians of the timed steps")
        print(f"{'arm':16s} {'variant':7s} {'step s':>7s} {'gen s':>7s} {'update s':>8s} {'sync s':>7s} "
              f"{'gen tok/s':>9s} {'upd MFU':>7s} {'peak GiB':>8s} {'TRL-ctxrl |dlp|':>15s}")
        for r in _ready(sections["grpo"], "step_s", 16, with_variant=True):
            mfu = r.get("update_mfu")
            lp = r.get("trl_vs_ctxrl_lp_max", r.get("trl_vs_ctxrl_lp_error"))
            print(f"{r['arm']:16s} {r['variant']:7s} {r['step_s']:7.2f} {r['gen_s']:7.2f} {r['update_s']:8.2f} "
                  f"{fmt(r.get('sync_s'), '.3f'):>7s} {fmt(r.get('gen_tok_s')):>9s} "
                  f"{fmt(None if mfu is None else 100 * mfu, '.1f'):>7s} {r['peak_gib']:8.2f} "
                  f"{fmt(lp, '.2e') if isinstance(lp, float) else fmt(lp):>15s}")


def print_profile(row: dict, indent: str) -> None:
    """One line of a profiled run (``profile_call``): wall, device-busy share, kernels, time by kind."""
    if row.get("profile_wall_s") is None:
        return
    kinds = ", ".join(f"{k} {v:.3f}" for k, v in sorted(row["profile_by_kind_s"].items(), key=lambda kv: -kv[1]))
    print(f"{indent}profiled: wall {row['profile_wall_s']:.3f} s, device busy {row['profile_busy_s']:.3f} s "
          f"({100 * (row['profile_busy_frac'] or 0):.0f}%), {row['profile_kernels']} kernels; {kinds}")


def print_stacks(stacks: dict | None, indent: str, top: int = 6) -> None:
    """The busiest ctxrl frames of each sampled thread (``host_stacks``)."""
    if not stacks:
        return
    for name, thread in stacks["threads"].items():
        frames = "; ".join(f"{frame} {100 * share:.0f}%" for frame, share in thread["ctxrl"][:top])
        print(f"{indent}host {name} ({thread['samples']} samples): {frames}")


# -- main ----------------------------------------------------------------------------------------------
def csv(kind, choices=None):
    def parse(text: str):
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if choices:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return items
    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", type=csv(str, SECTIONS), default=list(SECTIONS))
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a shape of ctxrl.models.shapes")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/grpo_step-<card>-<time>.json)")
    ap.add_argument("--smoke", action="store_true", help="every arm tiny (qwen2-test) on the CPU")
    ap.add_argument("--arm-timeout", type=int, default=900, help="seconds before an arm's process is stopped")
    d = ap.add_argument_group("decode")
    d.add_argument("--decode-arms", type=csv(str, DECODE_ARMS), default=list(DECODE_ARMS[:-1]))
    d.add_argument("--batches", type=csv(int), default=[64, 256, 512])
    d.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (decode and grpo)")
    d.add_argument("--new-tokens", type=int, default=256)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--mismatch-rows", type=int, default=128, help="rows whose log-probs are checked")
    d.add_argument("--copy-bytes", type=int, default=1 << 30)
    a = ap.add_argument_group("agentic")
    a.add_argument("--agentic-arms", type=csv(str, AGENTIC_ARMS), default=list(AGENTIC_ARMS[:-1]))
    a.add_argument("--tasks", type=int, default=64)
    a.add_argument("--samples", type=int, default=8)
    a.add_argument("--turns", type=int, default=4)
    a.add_argument("--task-tokens", type=int, default=128)
    a.add_argument("--turn-tokens", type=int, default=64)
    a.add_argument("--obs-tokens", type=int, default=100)
    a.add_argument("--tool-latency", type=float, default=0.05)
    a.add_argument("--agentic-repeats", type=int, default=1)
    learner = ap.add_argument_group("learner")
    learner.add_argument("--learner-arms", type=csv(str, LEARNER_ARMS), default=["padded", "packed", "flat"],
                         help="padded, packed (with --packed), flat, flat_compiled (train.flat_forward=compiled)")
    learner.add_argument("--learner-seqs", type=int, default=64)
    learner.add_argument("--learner-tokens", type=int, default=1024)
    learner.add_argument("--learner-max-tokens", type=int, default=8192, help="micro-batch token budget")
    learner.add_argument("--learner-updates", type=int, default=3, help="timed updates, after one warm-up")
    learner.add_argument("--chunk", type=int, default=1024, help="positions per chunk of the output head")
    learner.add_argument("--matmul-size", type=int, default=8192)
    learner.add_argument("--profile", action="store_true",
                         help="profile one more learner update, decode run (per batch) or agentic round per arm: "
                              "wall and device-busy time, time by kind of kernel, the busiest kernels")
    learner.add_argument("--packed", action="store_true",
                         help="also the learner's packed-sequences mode (train.pack_sequences)")
    g = ap.add_argument_group("grpo")
    g.add_argument("--grpo-arms", type=csv(str, GRPO_ARMS), default=list(GRPO_ARMS))
    g.add_argument("--variants", type=csv(str, VARIANTS), default=list(VARIANTS))
    g.add_argument("--prompts", type=int, default=64)
    g.add_argument("--generations", type=int, default=8)
    g.add_argument("--completion-tokens", type=int, default=256)
    g.add_argument("--ragged-range", type=csv(int), default=[64, 1024], help="lo,hi of the ragged budgets")
    g.add_argument("--grpo-steps", type=int, default=3, help="timed steps, after --grpo-warmup")
    g.add_argument("--grpo-warmup", type=int, default=1)
    g.add_argument("--ragged-arms", type=csv(str, GRPO_ARMS), default=["ctxrl", "trl_default", "trl_bf16_nockpt"],
                   help="the arms that also run the ragged variant (TRL's continuous batching cannot force lengths)")
    g.add_argument("--trl-micro-batch", type=int, default=0,
                   help="TRL rows per micro-batch, accumulated to one step (0: the most that fit the token budget)")
    g.add_argument("--trl-max-tokens", type=int, default=8192,
                   help="TRL micro-batch token budget (padded rows x width), no checkpointing; as ctxrl's")
    g.add_argument("--trl-ckpt-max-tokens", type=int, default=32768, help="the same with gradient checkpointing")
    g.add_argument("--ctxrl-engine", default="fastengine", choices=["fastengine", "hfengine"])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    return ap


SMOKE = dict(model="qwen2-test", dtype="float32", device="cpu", batches=[2, 4], prompt_tokens=8, new_tokens=4,
             repeats=1, mismatch_rows=4, copy_bytes=1 << 20, tasks=2, samples=2, turns=2, task_tokens=8,
             turn_tokens=4, obs_tokens=5, tool_latency=0.01, learner_seqs=4, learner_tokens=32,
             learner_max_tokens=64, learner_updates=1, chunk=16, matmul_size=128, prompts=2, generations=2,
             completion_tokens=4, ragged_range=[2, 6], grpo_steps=1, grpo_warmup=1, trl_max_tokens=20,
             trl_ckpt_max_tokens=40)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    if args.one:
        result = child(args)
        Path(args.result_file).write_text(json.dumps(result))
        return result
    import torch
    import transformers

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke (or --device cpu) on a machine without a GPU")
    card = torch.cuda.get_device_name() if cuda else "cpu"
    checks = {"fast": fast_engine_error(), "trl": trl_error()}
    trl_version = None if checks["trl"] else __import__("trl").__version__
    print(f"card: {card} | torch {torch.__version__} | transformers {transformers.__version__} | "
          f"trl {trl_version or '-'} | model {args.model} {args.dtype}", flush=True)
    report = {"card": card, "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl_version,
              "python": sys.version.split()[0], "args": {k: v for k, v in vars(args).items()
                                                          if k not in ("one", "result_file")},
              "sections": {s: [] for s in args.sections}}
    for section, arm, variant in arms_of(args):
        reason = skip_reason(section, arm, args, checks)
        if reason:
            if args.smoke:
                print(f"note: skipping {section} {arm}: {reason}", flush=True)
            entry = {"arm": arm, **({"variant": variant} if variant else {}),
                     **({"skipped": reason} if args.smoke else {"error": reason})}
        else:
            entry = run_one(":".join(x for x in (section, arm, variant) if x), argv, args)
        report["sections"][section].append(entry)
    print_tables(report)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        f"grpo_step-{re.sub(r'[^a-z0-9]+', '-', card.lower()).strip('-')}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
