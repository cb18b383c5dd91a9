"""The learner's decoder layers replayed as CUDA graphs, forward and backward, for one fixed-size bucket of tokens.

At Qwen2.5-0.5B's width an eager micro-batch of 8,192 tokens launches about 1,500 kernels, and the host takes
longer to launch them than the GPU takes to run them (docs/performance.md): the learner then needs 32,768-token
micro-batches to keep the GPU busy, and their activations (about 24 GiB) are most of a default step's memory.
Captured once as CUDA graphs (``torch.cuda.make_graphed_callables``: one forward and one backward graph a layer,
sharing one memory pool, replayed in the order they were captured), a layer's launches cost one replay, and a
smaller micro-batch runs as fast as the GPU allows.

A graph replays fixed shapes, so a micro-batch is laid into a ``Bucket`` (``pad``):

- its ``N`` tokens are followed by ``tokens - N`` padding tokens (id 0), cut into sequences of at most
  ``longest`` tokens, each attending only to itself (``cu_seqlens`` marks them), so no real token sees one;
- ``cu_seqlens`` is filled out to ``sequences + 1`` entries by repeating the total: empty sequences, which the
  variable-length attention kernel skips;
- the kernel's longest sequence is the bucket's ``longest``, at least every sequence's length.

Padding rows get zero gradient from the loss (the caller keeps the first ``N`` rows), and attention keeps them
apart, so their gradient stays exactly zero through every layer and adds nothing to the weights' gradients.

Not graphed: a pass without a gradient, one under activation checkpointing, and a model whose rotary tables
depend on the length asked for (longrope). A capture assumes no other thread of the process launches CUDA work
meanwhile: in one process rollouts never overlap the update (``ctxrl.config`` refuses ``distributed.max_staleness``
without Ray), and a failed capture leaves the eager layers.

One bucket is captured at a time, and a bucket only grows (``Bucket.covering``): a micro-batch that does not fit
the captured one is captured again, larger (the old graphs and their memory are let go). The learner sets
``LayerGraphs.min_tokens`` to its token budget, so every micro-batch of a run fits the first capture.
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TOKEN_STEP = 1024
"""Bucket sizes are multiples of this many tokens."""
MIN_SEQUENCES = 64
"""A bucket holds at least this many sequences (a power of two: growing it is rare)."""


@dataclass(frozen=True)
class Bucket:
    """The fixed shapes one set of graphs replays."""

    tokens: int
    """Rows of the flat micro-batch, padding included."""
    sequences: int
    """Entries of ``cu_seqlens`` less one: real sequences, padding sequences, then empty ones."""
    longest: int
    """The attention kernel's longest sequence (a power of two)."""

    def padding_sequences(self, n_tokens: int) -> int:
        """Sequences the padding after ``n_tokens`` real tokens is cut into."""
        return math.ceil((self.tokens - n_tokens) / self.longest)

    def holds(self, n_tokens: int, n_sequences: int, longest: int) -> bool:
        return (n_tokens <= self.tokens and longest <= self.longest
                and n_sequences + self.padding_sequences(n_tokens) <= self.sequences)

    @staticmethod
    def covering(n_tokens: int, n_sequences: int, longest: int, *, current: Bucket | None = None,
                 min_tokens: int = 0) -> Bucket:
        """``current`` if it holds the micro-batch; otherwise the smallest bucket at least as large as ``current`` in
        every dimension that does: tokens rounded up to ``TOKEN_STEP`` (at least ``min_tokens``), the longest
        sequence and the sequence count to powers of two."""
        if current is not None and current.holds(n_tokens, n_sequences, longest):
            return current
        floor = current or Bucket(0, MIN_SEQUENCES, 1)
        tokens = max(floor.tokens, _round_up(max(n_tokens, min_tokens, 1), TOKEN_STEP))
        long = max(floor.longest, _power_of_two(longest))
        padding = Bucket(tokens, 0, long).padding_sequences(n_tokens)
        return Bucket(tokens, max(floor.sequences, _power_of_two(n_sequences + padding)), long)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pad(ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, bucket: Bucket
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids``, ``positions`` ``[N]`` and ``cu_seqlens`` ``[S + 1]`` laid into ``bucket`` (module docstring):
    ``[tokens]``, ``[tokens]`` and ``[sequences + 1]``; the first ``N`` tokens and ``S + 1`` boundaries unchanged."""
    n, s = ids.shape[0], cu_seqlens.shape[0] - 1
    if not bucket.holds(n, s, 1):
        raise ValueError(f"{n} tokens in {s} sequences do not fit {bucket}")
    extra = bucket.tokens - n
    device = ids.device
    steps = torch.arange(extra, device=device)
    padding = bucket.padding_sequences(n)
    ends = (n + torch.arange(1, padding + 1, device=device) * bucket.longest).clamp(max=bucket.tokens)
    empty = torch.full((bucket.sequences - s - padding,), bucket.tokens, device=device)
    return (torch.cat([ids, ids.new_zeros(extra)]),
            torch.cat([positions, (steps % bucket.longest).to(positions.dtype)]),
            torch.cat([cu_seqlens, ends.to(cu_seqlens.dtype), empty.to(cu_seqlens.dtype)]))


class CaptureFailed(RuntimeError):
    """The layers could not be captured, or their replay did not reproduce the eager layers: train eagerly."""


CHECK_TOLERANCE = 0.05
"""How far (relative to the largest value) the replayed layers' output may be from the eager layers' on the capture's
own input: the same kernels in the same order agree to rounding; a wrong capture (an input read from a stale
address, a step left out) is far off."""


class _Layer(torch.nn.Module):
    """One decoder layer as ``block(layer, x, cos, sin, cu_seqlens, longest)``: a module (so that
    ``make_graphed_callables`` finds the layer's parameters) whose only inputs are tensors."""

    def __init__(self, block, layer: torch.nn.Module, longest: int) -> None:
        super().__init__()
        self.layer = layer
        self._block = block
        self._longest = longest

    def forward(self, x, cos, sin, cu_seqlens):
        return self._block(self.layer, x, cos, sin, cu_seqlens, self._longest)


class LayerGraphs:
    """Captured forward and backward graphs of every decoder layer, for one ``Bucket`` at a time."""

    def __init__(self, layers: list[torch.nn.Module], block, *, capture=None) -> None:
        self.layers = layers
        self.block = block
        """``block(layer, x, cos, sin, cu_seqlens, longest) -> x``: one layer's eager (or compiled) arithmetic."""
        self.capture = capture or capture_graphs
        """``capture(modules, sample_args) -> callables``: ``torch.cuda.make_graphed_callables`` (a test passes
        another)."""
        self.min_tokens = 0
        """Buckets hold at least this many tokens (the learner's token budget, so one capture serves a run)."""
        self._copy_grads = True
        self.bucket: Bucket | None = None
        self.captures = 0
        """How many times the graphs were captured (a growing bucket recaptures)."""
        self._graphed: tuple | None = None
        self._hooks: list = []

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
            bucket: Bucket) -> torch.Tensor:
        """Every layer over ``x`` ``[bucket.tokens, hidden]`` (padded by ``pad``), capturing first if ``bucket`` is
        not the captured one."""
        if bucket != self.bucket:
            self._capture(x, cos, sin, cu_seqlens, bucket)
        for layer in self._graphed:
            x = layer(x, cos, sin, cu_seqlens)
        return x

    def _capture(self, x, cos, sin, cu_seqlens, bucket: Bucket) -> None:
        self.release()  # (the old graphs' pool is let go before the new one is taken)
        hooked = [name for layer in self.layers for name, m in layer.named_modules()
                  if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks]
        if hooked:
            raise CaptureFailed(f"module hooks on the layers ({', '.join(sorted(set(hooked))[:3])}) would run only "
                                "while capturing, never on a replay")
        modules = tuple(_Layer(self.block, layer, bucket.longest) for layer in self.layers)
        # each layer's own static inputs, shaped and flagged like the live ones
        samples = tuple((x.detach().clone().requires_grad_(True), cos.clone(), sin.clone(), cu_seqlens.clone())
                        for _ in modules)
        try:
            graphed = self.capture(modules, samples)
            error = _disagreement(graphed, x.detach(), cos, sin, cu_seqlens, self.block, self.layers,
                                  bucket.longest)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the eager layers, which still train
            raise CaptureFailed(f"capturing them as CUDA graphs failed ({type(exc).__name__}: {exc})") from exc
        if not error <= CHECK_TOLERANCE:
            raise CaptureFailed(f"their CUDA graphs did not reproduce the eager layers (relative error {error:.2g})")
        # A replay hands back its weight gradients in buffers that the next replay overwrites; a parameter without a
        # gradient would take the buffer itself as its .grad, and the next micro-batch would overwrite and double it
        # instead of adding (the float32 masters' hook takes it off first, plain optimisers do not): each
        # parameter gets its own copy before it is accumulated, unless ``copy_grads`` says the gradients are consumed.
        self._graphed = graphed
        self._hook_copies()
        self.bucket = bucket
        self.captures += 1
        log.info("learner: decoder layers captured as CUDA graphs for %d tokens in %d sequences (at most %d long)",
                 bucket.tokens, bucket.sequences, bucket.longest)

    @property
    def copy_grads(self) -> bool:
        """Each parameter takes its own copy of a replay's weight gradient (``_capture`` says why). False where
        something consumes every gradient before the next replay: the float32 masters' hooks
        (``ctxrl.learner.precision.MasterAdamW``) take it from the parameter and add it into the master's by the end of
        the backward pass. The learner sets it from its optimiser; without the copies a micro-batch saves a launch a
        parameter and a read and a write of the layers' gradients."""
        return self._copy_grads

    @copy_grads.setter
    def copy_grads(self, value: bool) -> None:
        self._copy_grads = bool(value)
        if self._graphed is not None:  # (already captured: the hooks follow)
            self._hook_copies()

    def _hook_copies(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = [p.register_hook(_own_copy) for layer in self.layers for p in layer.parameters()
                       if p.requires_grad] if self._copy_grads else []

    def release(self) -> None:
        """Let the graphs, their memory pool and the gradient hooks go (a recapture, or the eager layers from now)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._graphed = self.bucket = None
        gc.collect()  # (make_graphed_callables' closures hold the graphs in reference cycles)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def _own_copy(grad: torch.Tensor) -> torch.Tensor:
    return grad.clone()


def capture_graphs(modules: tuple[torch.nn.Module, ...], samples: tuple) -> tuple:
    """Each module's forward and backward pass as CUDA graphs sharing one memory pool, in the order they run."""
    return torch.cuda.make_graphed_callables(modules, samples, num_warmup_iters=2)


def _disagreement(graphed, x, cos, sin, cu_seqlens, block, layers, longest: int) -> float:
    """Largest relative difference between the replayed and the eager layers: the whole stack's output on ``x``, and
    the first layer's gradients (of its input and of each weight) for one output gradient. (One layer's backward, so
    that the check holds no more than one eager layer's activations beside the graphs' pool.)"""
    with torch.no_grad():
        got, want = x, x
        for replay, layer in zip(graphed, layers):
            got = replay(got, cos, sin, cu_seqlens)
            want = block(layer, want, cos, sin, cu_seqlens, longest)
    worst = _relative(got, want)
    params = [p for p in layers[0].parameters() if p.requires_grad]
    probe = torch.randn(x.shape, generator=torch.Generator(device=x.device).manual_seed(0), device=x.device,
                        dtype=x.dtype)
    grads = []
    for run in (lambda v: graphed[0](v, cos, sin, cu_seqlens), lambda v: block(layers[0], v, cos, sin, cu_seqlens,
                                                                                  longest)):
        v = x.detach().clone().requires_grad_(True)
        found = torch.autograd.grad(run(v), [v, *params], probe, allow_unused=True)
        grads.append([None if g is None else g.clone() for g in found])
    for g, w in zip(*grads):
        worst = math.inf if (g is None) != (w is None) else worst if g is None else max(worst, _relative(g, w))
    return worst


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.float().abs().max().clamp(min=1e-30)
    return float((got.float() - want.float()).abs().max() / scale)
