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

``--partial TOKENS``: partial rollouts against waiting (docs/scaling.md). The workload becomes the multi-turn
environment of ``benchmarks/envs/long_tail.py`` (turns per episode drawn from ``--turns``, most short, a few long;
a random policy's turns end at every ``--stop-every``-th id of the vocabulary, named as ``rollout.stop_ids``, so they
run about that many tokens; a real model's end on their own), and the arms ``waiting`` (``rollout.partial_step_tokens
= 0``) and ``partial`` (``= TOKENS``), both with the decoupled objective (``algo.old_logprobs = "recompute"``) and no
episode deadline. A partial step trains the groups that finished, so the table adds the episodes trained per step,
trained episodes per second over the timed steps, and the tokens' mean staleness::

    python benchmarks/train_step.py --partial 256 --steps 8        # qwen2.5-0.5b on the GPU
    python benchmarks/train_step.py --smoke --partial 16
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
         "steps": 2, "device": "cpu", "dtype": "float32", "before_tokens": 256, "stop_every": 4, "obs_words": 4}


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
    ap.add_argument("--partial", type=int, default=0, metavar="TOKENS", help="partial rollouts of TOKENS per episode "
                    "and step against waiting, on the long-tailed multi-turn workload (replaces --arms)")
    ap.add_argument("--turns", default="1,1,1,1,2,2,3,4,6,8", help="--partial: the turn counts an episode draws from")
    ap.add_argument("--stop-every", type=int, default=64, help="--partial: a random policy's turn ends at every "
                    "this-many-th id of the vocabulary (its turns' mean length)")
    ap.add_argument("--obs-words", type=int, default=16, help="--partial: words of the environment's reply per turn")
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


PARTIAL_ARMS = ("waiting", "partial")
"""The arms of ``--partial``: ``rollout.partial_step_tokens`` 0 and the flag's."""


def partial_overrides(args, checkpoint: Path | str, real: bool) -> list[str]:
    """What ``--partial``'s workload changes in ``base_overrides``: the long-tailed multi-turn environment, room for
    its longest episode, the decoupled objective and no deadline (both arms), and for a random policy stop ids."""
    turns = max(int(n) for n in args.turns.split(","))
    room = prompt_tokens(checkpoint, args.prompt_words) + turns * (args.completion_tokens + args.obs_words + 16)
    overrides = ["env.name=long_tail:LongTailEnv", f"env.max_turns={turns}", f"rollout.max_total_tokens={room}",
                 "algo.old_logprobs=recompute", "rollout.episode_timeout_s=0"]
    if not real:
        vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
        overrides.append(f"rollout.stop_ids={list(range(args.stop_every, vocab, args.stop_every))}")
    return overrides


def run_arm(name: str, overrides: list[str], args, checkpoint: Path, work: Path) -> dict:
    run_dir = work / name
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENVS), str(ROOT), env.get("PYTHONPATH")) if p)
    env["CTXRL_BENCH_PROMPT_WORDS"] = str(args.prompt_words)
    env["CTXRL_BENCH_TURNS"], env["CTXRL_BENCH_OBS_WORDS"] = args.turns, str(args.obs_words)
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

    seconds = sum(r["time_step"] for r in timed)
    return {"steps_timed": len(timed), "step_s": median("time_step"), "rollout_s": median("time_rollout"),
            "update_s": median("time_update"), "peak_gib": median("peak_gpu_gib"),
            "tokens": median("tokens"), "kv_slots": memory.get("kv_slots"),
            "learner_tokens": memory.get("learner_tokens"), "planned_gib": memory.get("planned_gib"),
            "micro_batches": median("learner_micro_batches"), "flat_forward": median("learner_flat_forward"),
            "trained_episodes": median("trained_episodes"),
            "episodes_per_s": round(sum(r["trained_episodes"] for r in timed) / seconds, 2) if seconds else None,
            "token_staleness": median("token_staleness_mean")}


def print_table(report: dict) -> None:
    print(f"\n{report['card']} | {report['model']} {report['dtype']} | {report['workload']}")
    columns = [("step s", "step_s", 7), ("rollout", "rollout_s", 8), ("update", "update_s", 7),
               ("peak GiB", "peak_gib", 9), ("KV slots", "kv_slots", 9), ("tokens/mb", "learner_tokens", 10),
               ("micro", "micro_batches", 6), ("flat", "flat_forward", 5)]
    if report.get("partial"):
        columns[3:] = [("episodes", "trained_episodes", 9), ("ep/s", "episodes_per_s", 7),
                       ("staleness", "token_staleness", 10), ("peak GiB", "peak_gib", 9)]
    print(f"{'arm':<10} " + " ".join(f"{title:>{w}}" for title, _, w in columns))
    for r in report["arms"]:
        if "error" in r:
            print(f"{r['arm']:<10} error: {r['error']}")
            continue
        print(f"{r['arm']:<10} " + " ".join(f"{'-' if r.get(k) is None else r.get(k):>{w}}" for _, k, w in columns))


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    from ctxrl.models.named import named_model
    from ctxrl.models.shapes import save_random_checkpoint

    real = named_model(args.model) is not None
    if real:  # a real model: its own weights, and replies that may stop early
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
              "versions": versions(), "arms": [], "partial": args.partial}
    arms = [arm_overrides(spec, args) for spec in args.arms.split(",")]
    if args.partial:
        workload = partial_overrides(args, checkpoint, real)
        arms = [(name, [*workload, f"rollout.partial_step_tokens={tokens}"])
                for name, tokens in zip(PARTIAL_ARMS, (0, args.partial))]
        report["workload"] = (f"{args.prompts} prompts x {args.generations} episodes of {args.turns} turns (turns of "
                              f"at most {args.completion_tokens} tokens"
                              f"{'' if real else f', a stop id every {args.stop_every}'}), {args.steps} steps")
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in arms:
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
