"""Adding a low-precision gradient into its float32 master's (``ctxrl.train.grad_accumulate``): the Triton program
(run in Triton's interpreter where Triton is installed; CI has none) equals ``master.add_(grad)`` bit for bit, and
the fallback is taken wherever the program does not apply."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from ctxrl.train import grad_accumulate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fallback_is_the_plain_float32_add(dtype):
    g = torch.Generator().manual_seed(0)
    master = torch.randn(1000, generator=g)
    grad = torch.randn(1000, generator=g).to(dtype)
    want = master.clone().add_(grad)
    assert not grad_accumulate.kernel_applies(master, grad)  # (the CPU)
    grad_accumulate.accumulate(master, grad)
    assert torch.equal(master, want)


def test_the_program_applies_only_to_contiguous_float32_masters_of_a_low_precision_gradient():
    if grad_accumulate.triton is None:
        pytest.skip("no Triton here")
    master, grad = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    assert not grad_accumulate.kernel_applies(master, grad)  # CPU tensors


KERNEL_SCRIPT = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from ctxrl.train import grad_accumulate as G
assert G.triton is not None
g = torch.Generator().manual_seed(1)
for n in (1, 4095, 4096, 4097, 3 * 4096 + 17):  # (block edges)
    for dtype in (torch.bfloat16, torch.float16):
        master = torch.randn(n, generator=g)
        grad = (torch.randn(n, generator=g) * 3).to(dtype)
        want = master.clone().add_(grad)
        G.accumulate(master, grad, kernel=True)
        assert torch.equal(master, want), (n, dtype)
print("SAME")
"""


def test_the_triton_program_equals_the_float32_add_in_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], env=dict(os.environ, TRITON_INTERPRET="1"),
                            capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SAME" in result.stdout
