"""Peak GPU memory and time of one learner update, before and after mixed precision / chunked log-probs / LoRA.

One PPO update (one optimiser step) over ``--seqs`` sequences of ``--tokens`` tokens (the first
quarter prompt, the rest sampled), on a random-init model of a Qwen2.5 shape
(``ctxrl.models.shapes``: the shape sets memory and speed, the weights do not). Each setting runs
in its own process, so one that runs out of memory is reported as such and the next starts clean:

- ``legacy``: what ctxrl did before: bf16 weights trained directly (no fp32 master), the model's
  full logits, micro-batches of ``--legacy-rows`` rows (32, the old default), no gradient checkpointing;
- ``mixed``: a bf16 model with float32 master weights and AdamW state in the optimiser
  (``ctxrl.learner.precision``), chunked log-probs, micro-batches of ``--max-tokens`` tokens;
- ``mixed+ckpt``: the same with gradient checkpointing (and micro-batches of ``--ckpt-max-tokens``);
- ``lora`` / ``lora+ckpt``: rank-``--lora-rank`` adapters on every linear layer over a frozen bf16 base.

Every setting also holds the engine's copy of the weights (bf16; a LoRA run's shares the base), as
a one-GPU run does. Reported: ``torch.cuda.max_memory_allocated`` over all ``--updates`` updates (the
first creates the optimiser state), the median time of the updates after the first, and tokens per second::

    python benchmarks/learner_memory.py --shape qwen2.5-0.5b --settings legacy,mixed,mixed+ckpt
    python benchmarks/learner_memory.py --shape qwen2.5-7b --settings lora+ckpt
    python benchmarks/learner_memory.py --smoke        # a few-MB model on the CPU: does it run?
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SETTINGS = ("legacy", "mixed", "mixed+ckpt", "lora", "lora+ckpt")


def batch(vocab: int, seqs: int, tokens: int, seed: int = 0):
    import torch

    from ctxrl.learner.batch import collate
    from ctxrl.types import Episode, Task

    g = torch.Generator().manual_seed(seed)
    prompt = tokens // 4
    rows = []
    for i in range(seqs):
        ids = torch.randint(3, vocab, (tokens,), generator=g).tolist()
        behaviour = (-torch.rand(tokens, generator=g) * 4).tolist()
        rows.append(Episode(task=Task(id=str(i), prompt="p", answer="a"), input_ids=ids,
                            loss_mask=[0] * prompt + [1] * (tokens - prompt),
                            behavior_logprobs=[0.0] * prompt + behaviour[prompt:], turn_index=[0] * tokens))
    return collate(rows, 0, advantages=[1.0 if i % 2 else -1.0 for i in range(seqs)])


def child(args) -> dict:
    import torch

    from ctxrl.learner.learner import Learner, LearnerSettings
    from ctxrl.learner.policy import Policy, enable_gradient_checkpointing
    from ctxrl.learner.precision import Precision
    from ctxrl.models.lora import wrap_lora
    from ctxrl.models.shapes import random_model
    from ctxrl.sections import LoRAConfig, TrainConfig

    setting, device = args.one, args.device
    cuda = device.startswith("cuda")
    storage = "bfloat16" if cuda else "float32"
    lora = setting.startswith("lora")
    legacy = setting == "legacy"
    precision = Precision(storage, "model" if legacy else "float32", device)
    model = random_model(args.shape, precision.storage, device)
    if lora:
        model = wrap_lora(model, LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank),
                          adapter_dtype=precision.storage)
    if setting.endswith("+ckpt"):
        enable_gradient_checkpointing(model)
    policy = Policy(model, precision, lora=LoRAConfig(rank=args.lora_rank) if lora else None)
    engine_copy = policy.engine_model()  # held as a one-GPU run holds it
    rows = args.legacy_rows if legacy else args.seqs
    settings = LearnerSettings(train=TrainConfig(mini_batches=1, micro_batch_size=rows,
                                                 logprob_chunk_tokens=0 if legacy else args.chunk),
                               micro_batch_tokens=0 if legacy else
                               (args.ckpt_max_tokens if setting.endswith("+ckpt") else args.max_tokens))
    learner = Learner(model, precision.optimizer(policy.trainable_parameters(), lr=1e-6), settings, pad_token_id=0,
                      precision=precision)
    data = batch(model.config.vocab_size, args.seqs, args.tokens)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.updates):
        start = time.perf_counter()
        metrics = learner.update(data)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:] or times)  # the first update also creates the optimiser state
    params = sum(p.numel() for p in model.parameters())
    shared = {p.data_ptr() for p in model.parameters()}  # a LoRA engine shares the base: count only its own
    trainable = sum(p.numel() for p in policy.trainable_parameters())
    return {"setting": setting, "shape": args.shape, "seqs": args.seqs, "tokens": args.tokens,
            "params_b": round(params / 1e9, 3), "trainable_params": trainable,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0,
            "reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else 0.0,
            "step_s": round(step, 2), "first_step_s": round(times[0], 2),
            "tokens_per_s": round(args.seqs * args.tokens / step),
            "loss": metrics["loss"], "skipped": metrics["skipped"],
            "engine_copy_bytes": sum(p.numel() * p.element_size() for p in engine_copy.parameters()
                                     if p.data_ptr() not in shared),
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def run_one(setting: str, args) -> dict:
    command = [sys.executable, __file__, "--one", setting, "--shape", args.shape, "--seqs", str(args.seqs),
               "--tokens", str(args.tokens), "--device", args.device, "--max-tokens", str(args.max_tokens),
               "--ckpt-max-tokens", str(args.ckpt_max_tokens), "--chunk", str(args.chunk),
               "--lora-rank", str(args.lora_rank), "--updates", str(args.updates),
               "--legacy-rows", str(args.legacy_rows)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        oom = "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr
        return {"setting": setting, "shape": args.shape, "seqs": args.seqs, "tokens": args.tokens,
                "error": "out of memory" if oom else proc.stderr.strip().splitlines()[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--settings", default="legacy,mixed,mixed+ckpt")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=8192, help="micro-batch token budget (no checkpointing)")
    parser.add_argument("--ckpt-max-tokens", type=int, default=32768,
                        help="micro-batch token budget with checkpointing")
    parser.add_argument("--chunk", type=int, default=1024, help="positions per chunk of the output head")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--legacy-rows", type=int, default=32, help="rows per micro-batch of the legacy setting")
    parser.add_argument("--updates", type=int, default=4, help="updates; the step time is the median after the first")
    parser.add_argument("--smoke", action="store_true", help="qwen2-test on the CPU, 4 x 64 tokens")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.seqs, args.tokens = "qwen2-test", "cpu", 4, 64
        args.max_tokens, args.ckpt_max_tokens, args.chunk, args.updates = 128, 256, 32, 1
    if args.one:
        print(json.dumps(child(args)))
        return []
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    rows = [run_one(s, args) for s in settings]
    print(f"{'shape':14s} {'setting':11s} {'batch':>9s} {'peak GiB':>9s} {'step s':>7s} {'tok/s':>8s} "
          f"{'trainable M':>11s}")
    for r in rows:
        size = f"{r['seqs']}x{r['tokens']}"
        if "error" in r:
            print(f"{r['shape']:14s} {r['setting']:11s} {size:>9s} {r['error']}")
        else:
            print(f"{r['shape']:14s} {r['setting']:11s} {size:>9s} {r['peak_gib']:9.2f} {r['step_s']:7.2f} "
                  f"{r['tokens_per_s']:8d} {r['trainable_params'] / 1e6:11.2f}")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    return rows


if __name__ == "__main__":
    main()
