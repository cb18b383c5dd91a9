"""The learner on 1 and on N GPUs (torch.distributed, NCCL): throughput, and the loss against the 1-GPU loss.

One command runs every world size in turn, each as its own ``torchrun`` (``python -m torch.distributed.run``)
over the same data, and prints a table::

    python benchmarks/data_parallel.py --gpus 1,2                  # on a machine with 2 GPUs
    python benchmarks/data_parallel.py --smoke                     # gloo on the CPU, a tiny model: does it run?

Workload: a random-init model of ``--shape`` (Qwen2.5-0.5B) in bf16 with float32 master weights, one PPO
update over ``--seqs`` sequences of lengths drawn uniformly in ``--lengths`` (seeded, so the shares of the
ranks are uneven in tokens), micro-batches of ``--max-tokens`` tokens; one warm-up update (it creates the
optimiser state) then ``--updates`` timed ones. Each rank trains on its share of the rows, the loss
normalised by the whole batch's token count, gradients summed across ranks
(``ctxrl.distributed.data_parallel``). Reported per world size: the median seconds per update, tokens per
second (the whole batch's tokens), the speed-up against 1 GPU, and the first update's loss and gradient norm
(computed before any step, from the same weights and data: they should equal the 1-GPU figures up to bf16
rounding) and the loss of the last update. Results go to ``--out`` as JSON.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="1,2", help="world sizes to run, comma-separated")
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--lengths", default="256,1024", help="lo,hi of the sequence lengths")
    ap.add_argument("--max-tokens", type=int, default=32768, help="micro-batch token budget")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_parallel.json"))
    ap.add_argument("--smoke", action="store_true", help="gloo on the CPU, a tiny model, short sequences")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap


SMOKE = dict(shape="qwen2-test", seqs=6, lengths="6,20", max_tokens=64, updates=1, device="cpu", dtype="float32")


def worker(args) -> None:
    """One rank: the update, timed; rank 0 writes the figures to ``args.worker``."""
    import torch
    import torch.distributed as dist

    from ctxrl.distributed.data_parallel import DataParallel
    from ctxrl.learner.batch import collate
    from ctxrl.learner.learner import Learner, LearnerSettings
    from ctxrl.learner.precision import Precision
    from ctxrl.models.shapes import random_model
    from ctxrl.sections import TrainConfig
    from ctxrl.types import Episode, Task

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(local)
    parallel = DataParallel.from_environment(device)
    world = 1 if parallel is None else parallel.world
    precision = Precision(args.dtype, "float32", device)
    model = random_model(args.shape, precision.storage, device, seed=0)
    settings = LearnerSettings(train=TrainConfig(mini_batches=1, micro_batch_size=args.seqs),
                               micro_batch_tokens=args.max_tokens)
    learner = Learner(model, precision.optimizer(model.parameters(), lr=1e-6), settings, pad_token_id=0,
                      precision=precision, parallel=parallel)
    lo, hi = (int(x) for x in args.lengths.split(","))
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = []
    for i in range(args.seqs):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompt = n // 4
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        behaviour = (-torch.rand(n - prompt, generator=g) * 4).tolist()
        rows.append(Episode(task=Task(id=str(i), prompt="p", answer="a"), input_ids=ids,
                            loss_mask=[0] * prompt + [1] * (n - prompt),
                            behavior_logprobs=[0.0] * prompt + behaviour, turn_index=[0] * n))
    batch = collate(rows, 0, advantages=[1.0 if i % 2 else -1.0 for i in range(args.seqs)])
    tokens = int(batch.lengths.sum())
    mine, _ = learner._share(batch)
    times, metrics = [], []
    for _ in range(args.updates + 1):
        if args.device == "cuda":
            torch.cuda.synchronize()
        if parallel is not None:
            dist.barrier()
        t0 = time.perf_counter()
        metrics.append(learner.update(batch))
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    my_tokens = int(batch.lengths[mine].sum())
    shares = [my_tokens]
    if parallel is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, my_tokens)
        shares = gathered
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if args.device == "cuda" else 0.0
    if parallel is None or parallel.rank == 0:
        s = statistics.median(times[1:])
        Path(args.worker).write_text(json.dumps({
            "world": world, "seconds": round(s, 4), "first_s": round(times[0], 2), "tokens": tokens,
            "tok_s": round(tokens / s), "tokens_per_rank": shares,
            "first_loss": metrics[0]["loss"], "first_grad_norm": metrics[0]["grad_norm"],
            "last_loss": metrics[-1]["loss"], "peak_gib": round(peak, 2),
            "card": torch.cuda.get_device_name(local) if args.device == "cuda" else "cpu",
            "torch": torch.__version__}))
    if parallel is not None:
        parallel.close()  # (exiting with gloo still up is now and then aborted at exit)


def run_world(args, world: int, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                   str(Path(__file__).resolve()), *argv, "--worker", str(result)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not result.exists():
            return {"world": world, "error": (done.stderr or done.stdout)[-2000:]}
        row = json.loads(result.read_text())
        row["process_s"] = round(time.perf_counter() - started, 1)
        return row


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        argv = [a for a in argv if a != "--smoke"] + [f"--{k.replace('_', '-')}={v}" for k, v in SMOKE.items()]
    if args.worker:
        worker(args)
        return []
    child = [a for i, a in enumerate(argv) if not a.startswith("--gpus") and (i == 0 or argv[i - 1] != "--gpus")]
    rows = [run_world(args, int(w), child) for w in args.gpus.split(",")]
    base = next((r for r in rows if r.get("world") == 1 and "error" not in r), None)
    print(f"learner, data-parallel: {args.seqs} sequences of {args.lengths} tokens, {args.shape} {args.dtype}, "
          f"micro-batches of {args.max_tokens} tokens")
    print(f"{'GPUs':>4} {'s/update':>9} {'tok/s':>8} {'speed-up':>8} {'first loss':>12} {'grad norm':>10} "
          f"{'last loss':>12} {'tokens per rank':>18} {'peak GiB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['world']:>4} error: {r['error'][-400:]}")
            continue
        if base:
            r["speedup"] = round(base["seconds"] / r["seconds"], 2)
            r["first_loss_delta_vs_1"] = abs(r["first_loss"] - base["first_loss"])
        print(f"{r['world']:>4} {r['seconds']:>9.3f} {r['tok_s']:>8} {r.get('speedup', 0):>8.2f} "
              f"{r['first_loss']:>12.6f} {r['first_grad_norm']:>10.4g} {r['last_loss']:>12.6f} "
              f"{str(r['tokens_per_rank']):>18} {r['peak_gib']:>8.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
