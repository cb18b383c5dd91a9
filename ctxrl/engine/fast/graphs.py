"""Decode steps replayed from CUDA graphs: one graph per (batch bucket, cache-length bucket), captured on first use.

A decode step (``decode.Decoder.step``) reads and writes only tensors allocated once, so the kernels
of one step can be captured and replayed: one launch per step instead of hundreds, which is what
bounds decoding small models. Capturing runs the step twice (a warm-up on a side stream, where lazy
initialisation happens, then the capture itself), and both advance the step's state; the state is
saved before and put back after, so capture leaves no trace. All graphs share one memory pool.

If a capture fails, decoding goes on eagerly from then on, with one warning: slower, same numbers.
Weights are copied into the model in place (``load_weights``), so graphs stay valid across updates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class StepGraphs:
    """Captured graphs of ``step(n, key_len)``, which mutates the tensors in ``state``."""

    def __init__(self, step: Callable[[int, int], None], state: list[torch.Tensor], device: torch.device,
                 stats: dict, *, enabled: bool) -> None:
        self.step, self.state, self.device, self.stats = step, state, device, stats
        self.enabled = enabled
        """Replay graphs (turned off for good when a capture fails)."""
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def get(self, n: int, key_len: int) -> torch.cuda.CUDAGraph | None:
        """The captured decode step for ``n`` rows (``None``, and eager steps from now on, if capture fails)."""
        graph = self._graphs.get((n, key_len))
        if graph is not None:
            return graph
        try:
            return self._capture(n, key_len)
        except Exception as exc:  # noqa: BLE001 - slower, same numbers
            log.warning("fast engine: CUDA graph capture failed (%s); decoding without graphs", exc)
            self.enabled = False
            return None

    def _capture(self, n: int, key_len: int) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        saved = [t.clone() for t in self.state]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (lazy initialisation happens outside the capture)
            self.step(n, key_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip(self.state, saved):
            t.copy_(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.step(n, key_len)
        for t, s in zip(self.state, saved):
            t.copy_(s)
        self._graphs[(n, key_len)] = graph
        self.stats["graphs"] += 1
        self.stats["capture_seconds"] += time.perf_counter() - start
        return graph
