"""HFEngine on a GPU (or the CPU): is it right there, and how fast does it sample?

Two parts, printed as tables:

1. **Checks** (each model, each dtype): the engine's behaviour log-probs against the learner's
   recomputed log-probs for the same ids (max and mean absolute difference: exact-ish in fp32,
   the bf16 mismatch that truncated importance sampling exists for), and seeded sampling that
   gives the same tokens alone and inside a batch.
2. **Throughput**: new tokens per second for several batch sizes, HFEngine against HF
   ``model.generate`` (same model, same prompts, sampling at T=1, no stop token so every row
   makes exactly ``--new-tokens``); medians of ``--repeats`` runs, measured side by side.
   Each run gets prompts of a new length, as rollouts do (shape-keyed caches such as cuDNN's
   attention plans would flatter a benchmark that repeats one shape). On CUDA a third column
   runs the engine with PyTorch's cuDNN attention backend allowed, the default it opts out of.

The ``qwen2-0.5b`` model is a random-init ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's shape
(24 layers, hidden 896, vocab 151936): weights don't change the speed, and nothing is
downloaded. ``tiny`` is the project's tiny model; any HF path or hub name also works.

    python benchmarks/engine_throughput.py --device cuda --model qwen2-0.5b --dtype bfloat16
    python benchmarks/engine_throughput.py --device cpu --model tiny --batch-sizes 1,8 --new-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from ctxrl.engine.base import SamplingParams
from ctxrl.engine.hf import HFEngine
from ctxrl.learner.learner import token_logprobs


def load(name: str, dtype: torch.dtype, device: str):
    """(model, pad_token_id) for a named benchmark model or any HF path / hub name."""
    if name == "qwen2-0.5b":
        from ctxrl.models.shapes import random_model

        return random_model("qwen2.5-0.5b", dtype, device).eval(), 0
    from ctxrl.models.loader import load_model, load_tokenizer
    from ctxrl.train.tiny import ensure_model

    name = ensure_model(name)  # (a tiny model is built once)
    tokenizer = load_tokenizer(name)
    model = load_model(name, dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype], device=device)
    return model.eval(), tokenizer.pad_token_id


def prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # uneven lengths (75%..100% of --prompt-len), so left padding is exercised
    return [torch.randint(3, vocab, (length - (i * length // 4) // max(batch, 1),), generator=g).tolist()
            for i in range(batch)]


def engine_generate(engine: HFEngine, batch: list[list[int]], new_tokens: int, seed: int):
    params = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed + i) for i in range(len(batch))]

    async def go():
        return await asyncio.gather(*(engine.generate(p, q) for p, q in zip(batch, params)))
    return asyncio.run(go())


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def checks(model, pad: int, device: str, dtype: torch.dtype) -> dict:
    vocab = model.config.vocab_size
    batch = prompts(vocab, 6, 48, seed=1)
    engine = HFEngine(model, pad_token_id=pad, max_batch_size=64)
    out = engine_generate(engine, batch, 24, seed=100)
    diffs = []
    with torch.no_grad():
        for p, c in zip(batch, out):
            ids = torch.tensor([p + c.token_ids], device=device)
            lp = token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0, len(p) - 1:].float().cpu()
            diffs.append((lp - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    alone = [engine_generate(HFEngine(model, pad_token_id=pad), [batch[i]], 24, seed=100 + i)[0] for i in (0, 5)]
    same = sum(a.token_ids == out[i].token_ids for a, i in zip(alone, (0, 5)))
    return {"logprob_max_abs_diff": float(d.max()), "logprob_mean_abs_diff": float(d.mean()),
            "seeded_rows_same_alone_and_batched": f"{same}/2"}


def _padded(batch: list[list[int]], pad: int, device: str):
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(batch):
        ids[r, width - len(p):] = torch.tensor(p)
        attn[r, width - len(p):] = 1
    return ids.to(device), attn.to(device)


def throughput(model, pad: int, device: str, batch_sizes, prompt_len: int, new_tokens: int, repeats: int):
    """Median seconds per call of each variant; every call gets prompts of a new length (as rollouts do)."""
    import ctxrl.models.kernels as kernels

    vocab = model.config.vocab_size
    rows = []
    for bs in batch_sizes:
        # one prompt set per call (warm-up included), each a few tokens longer than the last
        sets = [prompts(vocab, bs, prompt_len + 5 * r, seed=1000 * bs + r) for r in range(repeats + 1)]

        def run_engine(batch, cudnn=False, bs=bs):
            engine = HFEngine(model, pad_token_id=pad, max_batch_size=max(bs, 1))
            saved = kernels.ALLOW_CUDNN_ATTENTION
            kernels.ALLOW_CUDNN_ATTENTION = cudnn  # what ctxrl.models.kernels.attention_kernels reads per call
            try:
                engine_generate(engine, batch, new_tokens, seed=7)
            finally:
                kernels.ALLOW_CUDNN_ATTENTION = saved
                engine.close()

        def run_hf(batch):
            ids, attn = _padded(batch, pad, device)
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=attn, do_sample=True, top_k=0, top_p=1.0,
                               temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               pad_token_id=pad)

        variants = {"ctxrl": run_engine, "hf_generate": run_hf}
        if device.startswith("cuda"):
            variants["ctxrl_cudnn_attention"] = lambda batch: run_engine(batch, cudnn=True)
        times = {}
        for name, fn in variants.items():
            fn(sets[0])  # warm-up
            sync(device)
            ts = []
            for batch in sets[1:]:
                t0 = time.perf_counter()
                fn(batch)
                sync(device)
                ts.append(time.perf_counter() - t0)
            times[name] = statistics.median(ts)
        tokens = bs * new_tokens
        row = {"batch": bs, **{f"{k}_tok_s": tokens / v for k, v in times.items()},
               "ratio_ctxrl_over_hf": times["hf_generate"] / times["ctxrl"]}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", action="append", help="qwen2-0.5b, tiny, or an HF path/name (repeatable)")
    ap.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-throughput", action="store_true", help="checks only")
    ap.add_argument("--json", help="also write all figures to this file")
    args = ap.parse_args(argv)
    models = args.model or ["qwen2-0.5b"]
    dtypes = [getattr(torch, d) for d in (args.dtype or ["float32", "bfloat16"])]
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    if args.device.startswith("cuda"):
        print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)
    report = {"device": args.device, "checks": [], "throughput": []}
    for name in models:
        for dtype in dtypes:
            model, pad = load(name, dtype, args.device)
            row = {"model": name, "dtype": str(dtype).split(".")[-1], **checks(model, pad, args.device, dtype)}
            report["checks"].append(row)
            print("check", json.dumps(row), flush=True)
            if not args.no_throughput:
                for r in throughput(model, pad, args.device, sizes, args.prompt_len, args.new_tokens, args.repeats):
                    r = {"model": name, "dtype": row["dtype"], **r}
                    report["throughput"].append(r)
                    print("speed", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
                          flush=True)
            del model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    print(f"\nthroughput: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per row, "
          f"median of {args.repeats}")
    print(f"{'model':<12} {'dtype':<9} {'batch':>5} {'ctxrl tok/s':>12} {'HF generate tok/s':>18} {'ratio':>6} "
          f"{'ctxrl+cuDNN attn tok/s':>23}")
    for r in report["throughput"]:
        cudnn = r.get("ctxrl_cudnn_attention_tok_s")
        print(f"{r['model']:<12} {r['dtype']:<9} {r['batch']:>5} {r['ctxrl_tok_s']:>12.0f} "
              f"{r['hf_generate_tok_s']:>18.0f} {r['ratio_ctxrl_over_hf']:>6.2f} "
              f"{'-' if cudnn is None else str(round(cudnn)):>23}")
    print(f"\n{'model':<12} {'dtype':<9} {'max |dlogp|':>12} {'mean |dlogp|':>13} seeded same alone/batched")
    for c in report["checks"]:
        print(f"{c['model']:<12} {c['dtype']:<9} {c['logprob_max_abs_diff']:>12.2e} "
              f"{c['logprob_mean_abs_diff']:>13.2e} {c['seeded_rows_same_alone_and_batched']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
