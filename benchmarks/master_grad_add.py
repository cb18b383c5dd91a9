"""Adding a model's bf16 gradients into its float32 masters' once: one ``add_`` a parameter against ``Adder``.

Under float32 masters every micro-batch after a step's first adds each parameter's bf16 gradient into its
master's float32 one (``ctxrl.learner.precision.MasterAdamW``). This times that add alone, over the parameter shapes
of a ``ctxrl.models.shapes`` model (built on the meta device: no weights), as it was (one ``add_`` a parameter:
torch's mixed-dtype kernel) and as it is (``ctxrl.learner.grad_accumulate.Adder``: one Triton program on CUDA), and
checks the two sums are equal bit for bit. Medians of ``--repeats`` timed adds after one warm-up::

    python benchmarks/master_grad_add.py                      # qwen2.5-0.5b on the GPU
    python benchmarks/master_grad_add.py --smoke              # a few-MB shape on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file from anywhere, ctxrl installed or not
    sys.path.insert(0, str(ROOT))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a shape of ctxrl.models.shapes")
    ap.add_argument("--device", default=None, help="default: cuda if there is one, else cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--smoke", action="store_true", help="qwen2-test on the CPU, 2 repeats")
    return ap


def _timed(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    import torch

    from ctxrl.learner.grad_accumulate import Adder, _program, applies
    from ctxrl.models.shapes import random_model

    args = parser().parse_args(argv)
    if args.smoke:
        args.model, args.device, args.repeats = "qwen2-test", "cpu", 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = [p.shape for p in random_model(args.model, torch.bfloat16, "meta").parameters()]
    g = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, generator=g, device=device).to(torch.bfloat16) for s in shapes]
    masters = [torch.randn(s, generator=g, device=device) for s in shapes]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    adder = Adder()

    want = [m.clone().add_(s) for m, s in zip(masters, grads)]
    got = [m.clone() for m in masters]
    adder.add_into(got, grads)
    sync()
    equal = all(torch.equal(a, b) for a, b in zip(got, want))

    elements = sum(s.numel() for s in grads)
    moved = elements * (2 + 4 + 4)  # read bf16, read and write float32
    rows = []
    for arm, fn in (("per_parameter", lambda: [m.add_(s) for m, s in zip(masters, grads)]),
                    ("adder", lambda: adder.add_into(masters, grads))):
        seconds = _timed(fn, args.repeats, sync)
        rows.append({"arm": arm, "ms": round(seconds * 1e3, 3), "tb_s": round(moved / seconds / 1e12, 3)})
    program = _program() is not None and applies(masters[0], grads[0]) and adder._checked.get(device, False)
    report = {"model": args.model, "device": str(device),
              "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "tensors": len(grads), "elements": elements, "triton_program": bool(program), "equal": equal,
              "arms": rows}
    print(f"{report['card']} | {args.model}: {len(grads)} tensors, {elements:,} gradients | Triton program: "
          f"{'yes' if program else 'no (one add_ a pair)'} | sums equal: {equal}")
    for row in rows:
        print(f"  {row['arm']:14s} {row['ms']:8.3f} ms  {row['tb_s']:6.3f} TB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
