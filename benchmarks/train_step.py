"""``ctxrl train`` itself, timed end to end: one RL step of the real command at default and tuned settings.

``benchmarks/grpo_step.py`` times the pieces (the engine, the learner) and a hand-built GRPO step; this script
runs the command a user runs, ``python -m ctxrl train``, in its own process per arm, on a random-init
checkpoint of a real model's shape (``ctxrl.models.shapes.save_random_checkpoint``: written once under
``--cache``) and the one-turn environment of ``benchmarks/envs/fixed_length.py`` (a prompt of ``--prompt-words``
tokens, replies of exactly ``--completion-tokens``: a random policy never stops, a random reward). The
workload by default: 64 prompts x 8 completions of 256 tokens after a 128-token prompt (the prompt words and
the chat template's markers), no warm start, one evaluation task per split.

Arms (``--arms``):
- ``default``: the command with no setting changed (the sizes the memory plan chooses);
- ``before``: the defaults before issue 35, written out (``rollout.max_batch_size=128``,
  ``train.micro_batch_size=32``, 4096-token micro-batches less what 4 GiB of activations fit: 3,328 tokens for
  Qwen2.5-0.5B's shape, ``--before-tokens``);
- ``tuned``: the settings issue 35 measured fastest by hand (``rollout.max_batch_size=512``,
  ``train.micro_batch_size=512``, ``train.max_tokens_per_microbatch=32768``);
- ``NAME=override,override``: an arm of your own.

Reported per arm: the median over RL steps 2..N (``--steps``) of the step, its rollout and its update (the
update includes the weight sync into the engine), the peak GiB the allocator reserved (``peak_gpu_gib``), and the
sizes the run chose (its ``memory`` row: KV slots, learner tokens per micro-batch). JSON to ``--out``::

    python benchmarks/train_step.py                         # qwen2.5-0.5b on the GPU: default, before, tuned
    python benchmarks/train_step.py --model qwen2.5-1.5b --arms default,tuned
    python benchmarks/train_step.py --model smollm2-135m-instruct --arms default   # the real model
    python benchmarks/train_step.py --smoke                 # a few-MB shape on the CPU, 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file from anywhere, ctxrl installed or not
    sys.path.insert(0, str(ROOT))
ENVS = Path(__file__).resolve().parent / "envs"
ARMS = {
    "default": [],
    "before": ["rollout.max_batch_size=128", "train.micro_batch_size=32", "train.max_tokens_per_microbatch={before}"],
    "tuned": ["rollout.max_batch_size=512", "train.micro_batch_size=512", "train.max_tokens_per_microbatch=32768"],
}
"""Tokens the chat template adds around a prompt of words (system turn, markers, roles)."""
SMOKE = {"model": "qwen2-test", "prompts": 4, "generations": 2, "completion_tokens": 16, "prompt_words": 16,
         "steps": 2, "device": "cpu", "dtype": "float32", "before_tokens": 256}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a shape of ctxrl.models.shapes (random weights), or a "
                    "named real model (smollm2-135m-instruct: its replies may stop before --completion-tokens, so "
                    "compare its tokens per step)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--arms", default="default,before,tuned", help="comma-separated: default, before, tuned, or "
                    "NAME=section.key=value+section.key=value")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=120)
    ap.add_argument("--completion-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="RL steps per arm; the first is not counted")
    ap.add_argument("--before-tokens", type=int, default=3328, help="the old default micro-batch tokens")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("CTXRL_CACHE", Path.home() / ".cache/ctxrl"))
                    / "bench")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    ap.add_argument("--arm-timeout", type=int, default=900)
    ap.add_argument("--smoke", action="store_true", help="a few-MB shape on the CPU")
    ap.add_argument("extra", nargs="*", help="overrides for every arm, section.key=value")
    return ap


def arm_overrides(spec: str, args) -> tuple[str, list[str]]:
    if "=" in spec.split(".")[0] or spec not in ARMS:
        name, _, rest = spec.partition("=")
        if not rest:
            raise SystemExit(f"unknown arm {spec!r}: choose {', '.join(ARMS)} or NAME=section.key=value+...")
        return name, rest.split("+")
    return spec, [o.format(before=args.before_tokens) for o in ARMS[spec]]


def prompt_tokens(checkpoint: Path | str, words: int) -> int:
    """The rendered prompt's most tokens under the model's chat template (system turn, the words, the assistant
    header), so that every completion gets ``--completion-tokens`` before the run's length limit: each of the
    environment's words is one token under ``save_random_checkpoint``'s tokenizer; under a real model's, the
    prompt is counted as if every word were the one that takes the most tokens."""
    from ctxrl.models.loader import load_tokenizer
    from ctxrl.models.shapes import BENCH_WORDS

    sys.path.insert(0, str(ENVS))
    from fixed_length import FixedLengthEnv

    tokenizer = load_tokenizer(str(checkpoint))
    widest = max(BENCH_WORDS, key=lambda w: len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]))
    messages = [{"role": "system", "content": FixedLengthEnv.system_prompt},
                {"role": "user", "content": " ".join([widest] * words)}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return len(ids)


def base_overrides(args, checkpoint: Path) -> list[str]:
    return [f"model.name={checkpoint}", f"model.dtype={args.dtype}", f"model.device={args.device}",
            "env.name=fixed_length:FixedLengthEnv", "env.max_turns=1", "sft.enabled=false",
            f"rollout.tasks_per_step={args.prompts}", f"rollout.group_size={args.generations}",
            f"rollout.max_new_tokens={args.completion_tokens}",
            f"rollout.max_total_tokens={prompt_tokens(checkpoint, args.prompt_words) + args.completion_tokens}",
            "eval.tasks=1", "train.eval_every=0", "run.progress=false", "run.samples_per_step=0"]


def run_arm(name: str, overrides: list[str], args, checkpoint: Path, work: Path) -> dict:
    run_dir = work / name
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENVS), str(ROOT), env.get("PYTHONPATH")) if p)
    env["CTXRL_BENCH_PROMPT_WORDS"] = str(args.prompt_words)
    config = work / "empty.toml"  # (every setting is an override)
    config.write_text("")
    command = [sys.executable, "-m", "ctxrl", "train", str(config), "--run-dir", str(run_dir),
               "--steps", str(args.steps),
               *base_overrides(args, checkpoint), *args.extra, *overrides]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.arm_timeout)
    except subprocess.TimeoutExpired:
        return {"arm": name, "error": f"timed out after {args.arm_timeout} s"}
    wall = round(time.perf_counter() - t0, 1)
    print(f"[{name}] {wall} s", file=sys.stderr, flush=True)
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        oom = "out of memory" in proc.stderr or "OutOfMemoryError" in proc.stderr
        why = "out of memory" if oom else (lines[-1][:400] if lines else f"exit {proc.returncode}")
        return {"arm": name, "error": why, "process_s": wall}
    return {"arm": name, "overrides": overrides, "process_s": wall, **summarise(metrics)}


def summarise(metrics: Path) -> dict:
    """Medians of RL steps 2..N, and the run's chosen sizes."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("phase") == "rl"]
    timed = steps[1:] or steps
    memory = next((r for r in rows if r.get("phase") == "memory"), {})

    def median(key: str) -> float | None:
        values = [r[key] for r in timed if key in r]
        return round(statistics.median(values), 3) if values else None

    return {"steps_timed": len(timed), "step_s": median("time_step"), "rollout_s": median("time_rollout"),
            "update_s": median("time_update"), "peak_gib": median("peak_gpu_gib"),
            "tokens": median("tokens"), "kv_slots": memory.get("kv_slots"),
            "learner_tokens": memory.get("learner_tokens"), "planned_gib": memory.get("planned_gib"),
            "micro_batches": median("learner_micro_batches"), "flat_forward": median("learner_flat_forward")}


def print_table(report: dict) -> None:
    print(f"\n{report['card']} | {report['model']} {report['dtype']} | {report['workload']}")
    print(f"{'arm':<10} {'step s':>7} {'rollout':>8} {'update':>7} {'peak GiB':>9} {'KV slots':>9} {'tokens/mb':>10} "
          f"{'micro':>6} {'flat':>5}")
    for r in report["arms"]:
        if "error" in r:
            print(f"{r['arm']:<10} error: {r['error']}")
            continue
        cells = [r.get(k) for k in ("step_s", "rollout_s", "update_s", "peak_gib", "kv_slots", "learner_tokens",
                                    "micro_batches", "flat_forward")]
        widths = (7, 8, 7, 9, 9, 10, 6, 5)
        print(f"{r['arm']:<10} " + " ".join(f"{'-' if v is None else v:>{w}}" for v, w in zip(cells, widths)))


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    from ctxrl.models.named import named_model
    from ctxrl.models.shapes import save_random_checkpoint

    if named_model(args.model) is not None:  # a real model: its own weights, and replies that may stop early
        checkpoint = args.model
    else:
        checkpoint = save_random_checkpoint(args.model, args.cache / f"{args.model}-{args.dtype}", dtype=args.dtype)
    card = "cpu"
    if args.device.startswith("cuda"):
        import torch

        card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda unavailable"
    report = {"card": card, "model": args.model, "dtype": args.dtype,
              "workload": f"{args.prompts} prompts x {args.generations} completions of {args.completion_tokens} "
                          f"tokens after {args.prompt_words} prompt words, {args.steps} steps",
              "versions": versions(), "arms": []}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.arms.split(","):
            name, overrides = arm_overrides(spec, args)
            report["arms"].append(run_arm(name, overrides, args, checkpoint, Path(tmp)))
    print_table(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return report


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}


if __name__ == "__main__":
    main()
