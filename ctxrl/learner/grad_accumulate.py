"""Adding many low-precision gradients into their float32 masters' gradients, one program for the lot.

With float32 masters (``ctxrl.learner.precision.MasterAdamW``) every micro-batch's bf16 / fp16 gradient of every
parameter is added into its master's float32 gradient. One ``add_`` a parameter is about 290 launches a micro-batch
for Qwen2.5-0.5B, and torch runs ``float32 += bfloat16`` with its unvectorised mixed-dtype kernel: on an H200 the
update of 64 x 1024 tokens spent 61 ms in 2,030 of them (docs/performance.md, "Issue 35's targets, one call").
``add_into`` adds a list of pairs with one Triton program on CUDA: a grid of (blocks, tensors), each program
reading its pair's addresses and walking that tensor's blocks. Added in isolation on an H200, the model's 494M
gradients took 2.98 ms one ``add_`` a parameter and 1.32 ms as one program
(``benchmarks/results/master_grad_add-h200-oneoff.txt``). Elsewhere (the CPU, no Triton, other
dtypes or layouts) it is one ``add_`` a pair. The sum is the same bit for bit either way: the cast is exact and the
add is one float32 add.

CI has no GPU: the program checks itself against ``add_`` the first time it runs in a process (``_checked``), and a
disagreement turns it off for the process, with a warning.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict

import torch

log = logging.getLogger(__name__)

BLOCK = 2048
"""Elements a program adds per loop step."""
PROGRAMS_PER_TENSOR = 264
"""Programs that share one tensor's blocks (two per SM of an H100 / H200; small tensors leave most idle at once)."""
MAX_TENSORS = 65535
"""A launch's grid holds at most this many tensors (CUDA's limit on a grid's second dimension)."""
CACHED_ADDRESS_SETS = 64
"""Device tables of addresses kept for reuse: a micro-batch's pairs repeat their addresses through a step."""


@functools.cache
def _program():
    """The Triton program, or None where Triton is not installed (CPU builds of torch)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def add_into_kernel(dst_ptrs, src_ptrs, sizes, SRC_FP16: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(1)
        size = tl.load(sizes + t)
        dst = tl.load(dst_ptrs + t).to(tl.pointer_type(tl.float32))
        if SRC_FP16:
            src = tl.load(src_ptrs + t).to(tl.pointer_type(tl.float16))
        else:
            src = tl.load(src_ptrs + t).to(tl.pointer_type(tl.bfloat16))
        for block in range(tl.program_id(0), tl.cdiv(size, BLOCK), tl.num_programs(0)):
            offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            live = offsets < size
            total = tl.load(dst + offsets, mask=live) + tl.load(src + offsets, mask=live).to(tl.float32)
            tl.store(dst + offsets, total, mask=live)

    return add_into_kernel


def applies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the program can add ``src`` into ``dst``: a contiguous float32 CUDA tensor and a contiguous bf16 / fp16
    one of the same shape on the same card."""
    return (dst.is_cuda and src.device == dst.device and dst.dtype == torch.float32
            and src.dtype in (torch.bfloat16, torch.float16) and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous())


def launch_groups(pairs: list[tuple[torch.Tensor, torch.Tensor]], max_tensors: int = MAX_TENSORS) -> list[list]:
    """``pairs`` in order, cut into launches of at most ``max_tensors`` whose destinations are all different (two
    programs adding into one tensor at once would lose one's add; a later launch runs after the earlier one)."""
    groups: list[list] = [[]]
    seen: set[int] = set()
    for dst, src in pairs:
        if len(groups[-1]) >= max_tensors or dst.data_ptr() in seen:
            groups.append([])
            seen = set()
        groups[-1].append((dst, src))
        seen.add(dst.data_ptr())
    return [g for g in groups if g]


class Adder:
    """``add_into`` with its state: the device tables of addresses it made, and whether the program checked out."""

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._checked: dict[torch.device, bool] = {}

    def add_into(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """``dst += src`` in place for each pair (``dst`` float32, ``src`` its low-precision gradient)."""
        by_kind: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        program = _program() is not None  # (once a call, not once a pair: this runs every micro-batch)
        for dst, src in zip(dsts, srcs, strict=True):
            if program and applies(dst, src) and self._works(dst.device):
                by_kind.setdefault((dst.device, src.dtype), []).append((dst, src))
            else:
                dst.add_(src)
        for (device, dtype), pairs in by_kind.items():
            for group in launch_groups(pairs):
                self._launch(group, device, dtype)

    def _launch(self, pairs, device: torch.device, dtype: torch.dtype) -> None:
        key = tuple((d.data_ptr(), s.data_ptr(), d.numel()) for d, s in pairs)
        tables = self._tables.get(key)
        if tables is None:
            columns = list(zip(*key))
            tables = tuple(torch.tensor(c, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
                           for c in columns)
            self._tables[key] = tables
            if len(self._tables) > CACHED_ADDRESS_SETS:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        dst_ptrs, src_ptrs, sizes = tables
        with torch.cuda.device(device):
            _program()[(PROGRAMS_PER_TENSOR, len(pairs))](dst_ptrs, src_ptrs, sizes, SRC_FP16=dtype == torch.float16,
                                                           BLOCK=BLOCK)

    def _works(self, device: torch.device) -> bool:
        """The program's first run in this process on ``device``, against ``add_`` on tensors of block-edge sizes."""
        if device not in self._checked:
            try:
                ok = _self_check(self, device)
            except Exception as exc:  # noqa: BLE001 - a program that does not run is one that is not used
                log.warning("the multi-tensor gradient add failed its check (%s: %s); adding one tensor at a time",
                            type(exc).__name__, exc)
                ok = False
            else:
                if not ok:
                    log.warning("the multi-tensor gradient add disagreed with torch's add; adding one tensor at a "
                                "time")
            self._checked[device] = ok
        return self._checked[device]


def _self_check(adder: Adder, device: torch.device) -> bool:
    """Block-edge sizes, then infinities, signed zeros and subnormals; twice (the second launch reuses its table);
    compared bit for bit with ``add_``."""
    g = torch.Generator(device=device).manual_seed(0)
    sizes = (1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK * PROGRAMS_PER_TENSOR + 17)
    for dtype in (torch.bfloat16, torch.float16):
        tiny = torch.finfo(dtype).tiny
        special = torch.tensor([float("inf"), -float("inf"), -0.0, 0.0, tiny / 4, -tiny / 2, 1e-40, -1.0],
                               device=device)
        dsts = [torch.randn(n, generator=g, device=device) for n in sizes] + [special.flip(0).clone()]
        srcs = [(torch.randn(n, generator=g, device=device) * 3).to(dtype) for n in sizes] + [special.to(dtype)]
        for _ in range(2):
            want = [d.clone().add_(s) for d, s in zip(dsts, srcs)]
            adder._launch(list(zip(dsts, srcs)), device, dtype)
            if not all(torch.equal(d.view(torch.int32), w.view(torch.int32)) for d, w in zip(dsts, want)):
                return False
    return True


def _graph_task() -> int | None:
    """The id of the backward pass running on this thread (-1 outside one), or None where torch does not say."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else current()


class Waiting:
    """Gradients waiting to be added into float32 ones: added together (``Adder``) once ``FLUSH_BYTES`` of them wait,
    and when the backward pass that produced them ends. The first add of each pass asks for the flush at its end (a
    pass that raised leaves its pairs waiting: the next pass's end adds them). One stream is assumed: the gradients'
    producers and the adds run on the current one."""

    FLUSH_BYTES = 128 * 2**20
    """(Bounded so that gradients the backward pass would have freed wait in no more than this much memory.)"""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bytes = 0
        self.adder = Adder()
        self._lock = threading.Lock()  # (a model on several cards runs its hooks on one autograd thread per card)
        self._queued_for: int | None = None
        """The backward pass whose end already flushes (its graph task's id), or None: ask on every add."""

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst += src``, now or with others: within a backward pass, by its end at the latest; outside one, now."""
        task = _graph_task()
        if task is None or task != self._queued_for:  # (once a pass; a pass that raised had another id)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            except RuntimeError:  # (not inside a backward pass: nothing would call it)
                self.flush()
                with torch.no_grad():
                    dst.add_(src)
                return
            self._queued_for = task
        with self._lock:
            self.pairs.append((dst, src))
            self.bytes += src.numel() * src.element_size()
            full = self.bytes >= self.FLUSH_BYTES
        if full:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pairs, self.pairs, self.bytes = self.pairs, [], 0
        if pairs:
            with torch.no_grad():
                self.adder.add_into([d for d, _ in pairs], [s for _, s in pairs])

    def drop(self) -> None:
        """Forget what waits (its float32 gradients are being discarded)."""
        with self._lock:
            self.pairs, self.bytes = [], 0
