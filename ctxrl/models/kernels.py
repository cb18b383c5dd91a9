"""Which scaled-dot-product-attention kernels ctxrl lets PyTorch pick on CUDA.

cuDNN attention builds an execution plan per input shape (and per thread) and keeps it. ctxrl's
shapes change all the time: every decode step has a new key length, and every training batch is
padded to a new length. Decoding paid about 2 ms of planning per attention call, which is why it
is kept off. Training keeps it off too, for the same reason; ``benchmarks/gpu_memory.py`` found
no memory cost either way (a search_qa warm start + 5 RL steps on an H100: PyTorch reserved
1.16 GiB in both modes; 19.1 s with cuDNN off, 21.1 s with it allowed, one run each). Flash and
memory-efficient attention need no plan; the math kernel stays as the fallback for any mask or
dtype they refuse. Off CUDA this changes nothing.
"""

from __future__ import annotations

import contextlib

import torch

# Set True to let PyTorch choose cuDNN attention again (benchmarks/gpu_memory.py compares both).
ALLOW_CUDNN_ATTENTION = False


def attention_kernels(device: torch.device | str):
    """Context manager: SDPA without the cuDNN backend on a CUDA ``device``; a no-op elsewhere."""
    if torch.device(device).type != "cuda" or ALLOW_CUDNN_ATTENTION:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
