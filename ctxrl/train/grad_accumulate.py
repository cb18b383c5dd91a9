"""Adding a low-precision gradient into its float32 master's gradient, at the card's bandwidth.

With float32 masters (``ctxrl.train.precision.MasterAdamW``) every micro-batch's bf16 / fp16 gradient of every
parameter is added into its master's float32 gradient. torch runs ``float32 += bfloat16`` (and the cast alone) with
its unvectorised mixed-dtype kernel: on an H200 it was the learner's largest kernel once the layers ran as CUDA
graphs, 46-62 ms an update of Qwen2.5-0.5B at 8,192-token micro-batches (about 10 bytes a parameter moved at
about 570 GB/s), and its cost grows with the parameters and the micro-batches. On CUDA with Triton the add is one
vectorised program per block of 4,096 elements; elsewhere (the CPU, no Triton, other dtypes or layouts) it is
``master.add_(grad)``. The sum is the same bit for bit: the cast is exact and the add is one float32 add.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds go without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 4096


def reference(master: torch.Tensor, grad: torch.Tensor) -> None:
    master.add_(grad)


def kernel_applies(master: torch.Tensor, grad: torch.Tensor) -> bool:
    return (triton is not None and master.is_cuda and grad.device == master.device and master.dtype == torch.float32
            and grad.dtype in (torch.bfloat16, torch.float16) and master.shape == grad.shape
            and master.is_contiguous() and grad.is_contiguous())


if triton is not None:

    @triton.jit
    def _accumulate_kernel(master_ptr, grad_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offsets < n
        total = tl.load(master_ptr + offsets, mask=live) + tl.load(grad_ptr + offsets, mask=live).to(tl.float32)
        tl.store(master_ptr + offsets, total, mask=live)


def accumulate(master: torch.Tensor, grad: torch.Tensor, *, kernel: bool | None = None) -> None:
    """``master += grad`` in place (``master`` float32, ``grad`` its low-precision gradient). ``kernel``: force the
    Triton program on (True, as the tests do in Triton's interpreter) or off (False); None: where it applies."""
    use = kernel_applies(master, grad) if kernel is None else kernel
    if not use:
        reference(master, grad)
        return
    n = master.numel()
    _accumulate_kernel[(triton.cdiv(n, BLOCK),)](master, grad, n, BLOCK=BLOCK)
