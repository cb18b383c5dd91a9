"""Decoding on the device: every active slot advances one token per step, and chunks of steps run without the host.

Each slot's sampling state lives in device tensors indexed by slot: the token the next step feeds,
its position, its step counter (which of its seeded draws comes next), its seed, temperature and
greedy flag. ``Decoder.start`` sets them for the rows an admission round starts, drawing each first
token from its prefill logits. ``Decoder.step`` runs one step over slots ``0..n``: forward, draw,
record the id and log-prob in the chunk's output column, advance the counters; it reads nothing from
the host, so on CUDA it is replayed from a captured graph (``graphs``). A chunk in which a row
truncates (top-k, top-p) steps eagerly, with the filters read from the rows' requests.

``Decoder.launch`` queues up to ``decode_chunk`` steps and copies the chunk's ids and log-probs into
one of two (pinned) host buffers; the host reads chunk k (``Chunk``) while the device runs chunk k+1.
What the ids mean (stops, finished rows) is decided on the host, by the engine and ``rows.Row``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxrl.engine.base import SamplingParams
from ctxrl.engine.fast.graphs import StepGraphs
from ctxrl.engine.fast.model import Batch, DecoderView, SlotCache, bucket, to_device
from ctxrl.engine.fast.rows import Row
from ctxrl.engine.sampling import draw
from ctxrl.seeds import SEED_MODULUS


@dataclass
class Chunk:
    """Decode steps queued on the device: the rows they serve and where their outputs land on the host."""

    rows: dict[int, Row]
    steps: int
    buffer: tuple[torch.Tensor, torch.Tensor]
    done: torch.cuda.Event | None
    _lists: tuple[list, list] | None = None

    def wait(self) -> None:
        """Until the chunk's outputs are in the host buffer."""
        if self.done is not None:
            self.done.synchronize()

    def outputs(self, slot: int) -> list[tuple[int, float]]:
        """(id, log-prob) of each step of the chunk in ``slot``. The buffer becomes Python lists once per chunk (a
        conversion per row cost more than the rows' own bookkeeping)."""
        if self._lists is None:
            high = max(self.rows) + 1
            self._lists = (self.buffer[0][:high, : self.steps].tolist(), self.buffer[1][:high, : self.steps].tolist())
        return list(zip(self._lists[0][slot], self._lists[1][slot]))


class Decoder:
    """The slots' sampling state on the device and the decode steps over it; see the module docstring."""

    def __init__(self, view: DecoderView, cache: SlotCache, *, slots: int, decode_chunk: int,
                 kernel_attention: bool, cuda_graphs: bool, stats: dict) -> None:
        self.view, self.cache, self.device = view, cache, view.device
        self.slots, self.decode_chunk, self.capacity = slots, decode_chunk, cache.capacity
        self.kernel_attention = kernel_attention
        """The Triton kernel reads each row's own length: every step can attend over the whole capacity."""
        self.stats = stats
        dev = self.device
        self._tok = torch.zeros(slots, dtype=torch.long, device=dev)
        self._pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self._steps = torch.zeros(slots, dtype=torch.long, device=dev)
        self._seeds = torch.zeros(slots, dtype=torch.long, device=dev)
        self._temp = torch.ones(slots, 1, dtype=torch.float32, device=dev)
        self._greedy = torch.zeros(slots, dtype=torch.bool, device=dev)
        self._out_tok = torch.zeros(slots, decode_chunk, dtype=torch.long, device=dev)
        self._out_lp = torch.zeros(slots, decode_chunk, dtype=torch.float32, device=dev)
        self._col = torch.zeros(1, dtype=torch.long, device=dev)
        pin = dev.type == "cuda"
        self._host = [(torch.zeros(slots, decode_chunk, dtype=torch.long, pin_memory=pin),
                       torch.zeros(slots, decode_chunk, dtype=torch.float32, pin_memory=pin)) for _ in range(2)]
        self._arange = torch.arange(slots, device=dev)
        self.graphs = StepGraphs(self.step, [self._tok, self._pos, self._steps, self._col], dev, stats,
                                 enabled=cuda_graphs)

    def start(self, slots: list[int], params: list[SamplingParams], prompt_lengths: list[int],
              logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Draw the first token of a row in each of ``slots`` from its prefill ``logits`` and set the slot's state.

        Returns the ids and log-probs drawn."""
        dev = self.device
        index = to_device(slots, dev)
        seeds = to_device([p.seed % SEED_MODULUS for p in params], dev)
        temp = to_device([[p.temperature if p.temperature > 0 else 1.0] for p in params], dev, torch.float32)
        greedy = to_device([p.temperature <= 0 for p in params], dev, torch.bool)
        top_p = to_device([[p.top_p] for p in params], dev, torch.float32)
        token, logprob = draw(logits, temp, greedy, seeds, 0, [p.top_k for p in params], top_p)
        self._tok[index] = token
        self._pos[index] = to_device(prompt_lengths, dev)
        self._steps[index] = 1
        self._seeds[index] = seeds
        self._temp[index] = temp
        self._greedy[index] = greedy
        return token.tolist(), logprob.tolist()

    def launch(self, rows: dict[int, Row], high: int) -> Chunk | None:
        """Queue up to ``decode_chunk`` decode steps for the ``rows`` with budget left (by slot; the active slots
        are below ``high``); copy their outputs to the host."""
        live = {slot: row for slot, row in rows.items() if row.left > 0}
        if not live:
            return None
        n = bucket(high, 1, self.slots)
        steps = min(self.decode_chunk, max(row.left for row in live.values()))
        furthest = max(row.position + row.in_flight for row in live.values()) + steps + 1
        key_len = self.capacity if self.kernel_attention else bucket(furthest, 64, self.capacity)
        truncated = any(r.request.params.top_k > 0 or r.request.params.top_p < 1.0 for r in live.values())
        self._col.zero_()
        graph = self.graphs.get(n, key_len) if self.graphs.enabled and not truncated else None
        for _ in range(steps):
            if graph is not None:
                graph.replay()
            else:
                self.step(n, key_len, rows if truncated else None)
        for row in live.values():
            row.in_flight += steps
        self.stats["decode_steps"] += steps
        self.stats["chunks"] += 1
        buffer = self._host[self.stats["chunks"] % 2]
        buffer[0][:n].copy_(self._out_tok[:n], non_blocking=True)
        buffer[1][:n].copy_(self._out_lp[:n], non_blocking=True)
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done is not None:
            done.record()
        return Chunk(live, steps, buffer, done)

    def step(self, n: int, key_len: int, truncating: dict[int, Row] | None = None) -> None:
        """One decode step for slots ``0..n``: forward, sample, record, advance. No host sync unless ``truncating``
        (the rows by slot, whose top-k and top-p filter the draw)."""
        batch = Batch(tokens=self._tok[:n], positions=self._pos[:n], slots=self._arange[:n], rows=None,
                      row_of=None, offset=None, width=1, n_rows=n, key_len=key_len)
        logits = self.view.forward(batch, self.cache)
        top_k = top_p = None
        if truncating is not None:
            params = [truncating[s].request.params if s in truncating else None for s in range(n)]
            top_k = [p.top_k if p else 0 for p in params]
            top_p = torch.tensor([[p.top_p if p else 1.0] for p in params], device=self.device)
        token, logprob = draw(logits, self._temp[:n], self._greedy[:n], self._seeds[:n], self._steps[:n],
                              top_k, top_p)
        self._out_tok[:n].index_copy_(1, self._col, token.unsqueeze(1))
        self._out_lp[:n].index_copy_(1, self._col, logprob.unsqueeze(1))
        self._tok[:n].copy_(token)
        self._pos[:n].add_(1).clamp_(max=self.capacity - 1)
        self._steps[:n].add_(1)
        self._col.add_(1)
