"""``FastEngine``: continuous batching over a slot KV cache, decode steps in CUDA graphs, prefix reuse.

The same ``Engine`` protocol as ``HFEngine`` (which stays the CPU and reference implementation);
the same sampling maths, seeded per request and token, so a request samples the same ids alone
or beside others, in either engine up to floating-point differences in the logits.

How a request goes through it (one long-lived worker thread does all GPU work):

1. **Admission.** Between decode chunks, waiting requests take slots (``SlotTable``): an
   episode's next turn takes the slot its last turn left parked and prefills only the new tail
   (the observation); the samples of a GRPO group, which share their prompt, prefill it once and
   copy its keys and values into their own slots. New tokens of all admitted requests are
   prefilled together, packed without padding. The first token is sampled from the prefill's logits.
2. **Decode.** Every active row advances one token per step: forward, sampling, log-prob,
   the position and step counters, all on the GPU. On CUDA one step is a captured graph per
   (batch bucket, cache-length bucket); ``decode_chunk`` steps run per visit of the host.
3. **Harvest.** After a chunk the host reads the chunk's ids and log-probs (one transfer) and
   finds each row's end: a stop id, a stop string, or its budget. Tokens a row sampled after
   its end are dropped (its draws depend only on its own seed and step, so nothing else
   changes), and its slot is parked with the ids whose keys and values it holds.

``load_weights`` copies new weights into the model in place, so captured graphs stay valid, and
forgets every parked slot: keys and values computed by old weights are never reused.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from ctxrl.engine.base import Completion, SamplingParams
from ctxrl.engine.factory import DECODE_CHUNK, PREFILL_TOKENS, cache_fits, slot_capacity
from ctxrl.engine.fast.attention import triton_ready
from ctxrl.engine.fast.model import Batch, DecoderView, unsupported_reason
from ctxrl.engine.fast.slots import Placement, SlotTable
from ctxrl.engine.hf import StopStrings, copy_weights, validate_request
from ctxrl.engine.sampling import draw
from ctxrl.models.kernels import attention_kernels
from ctxrl.seeds import SEED_MODULUS

log = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_TOKENS = 4096
"""Cache length per slot when neither ``max_total_tokens`` nor a shorter model limit says otherwise."""


class UnsupportedModel(ValueError):
    """The fast engine cannot run this model (``HFEngine`` can)."""


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future = field(repr=False)
    loop: asyncio.AbstractEventLoop = field(repr=False)


@dataclass
class _Row:
    request: _Request
    budget: int
    stops: frozenset[int]
    stop_strings: StopStrings
    version: int
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    in_flight: int = 0
    """Decode steps queued on the device whose ids the host has not read yet."""

    @property
    def left(self) -> int:
        """Steps still worth queueing: the budget not yet sampled or in flight."""
        return self.budget - len(self.sampled) - self.in_flight

    @property
    def position(self) -> int:
        """Position of the token the next decode step feeds (the last sampled one)."""
        return len(self.request.prompt_ids) + len(self.sampled) - 1

    def add(self, token: int, logprob: float) -> str | None:
        """Append one sampled token; the finish reason if the row ends with it."""
        self.sampled.append(token)
        self.logprobs.append(logprob)
        if token in self.stops:
            return "stop"
        if self.stop_strings.reached(self.sampled):
            return "stop_string"
        if len(self.sampled) >= self.budget:
            return "length"
        return None


@dataclass
class _Chunk:
    """Decode steps queued on the device: the rows they serve and where their outputs land on the host."""

    rows: dict[int, _Row]
    steps: int
    buffer: tuple[torch.Tensor, torch.Tensor]
    done: torch.cuda.Event | None


def _bucket(n: int, smallest: int, largest: int) -> int:
    size = smallest
    while size < n:
        size *= 2
    return min(size, largest)


def _resolve(future: asyncio.Future, value, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class FastEngine:
    """Continuous-batching engine for Llama-layout models; see the module docstring."""

    def __init__(self, model, *, pad_token_id: int, max_batch_size: int = 64, seed: int = 0,
                 max_total_tokens: int | None = None, decode=None, decode_chunk: int = DECODE_CHUNK,
                 prefill_tokens: int = PREFILL_TOKENS, cuda_graphs: bool | None = None,
                 compile: bool | None = None) -> None:
        limit = int(getattr(model.config, "max_position_embeddings", DEFAULT_MAX_TOTAL_TOKENS))
        self.max_total_tokens = min(max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS, limit)
        reason = unsupported_reason(model, self.max_total_tokens)
        if reason is not None:
            raise UnsupportedModel(f"the fast engine cannot run this model: {reason}. "
                                   "Use the HF engine (rollout.engine = \"hf\").")
        if decode_chunk < 1 or prefill_tokens < 1 or max_batch_size < 1:
            raise ValueError("decode_chunk, prefill_tokens and max_batch_size must be >= 1")
        self.model = model.eval()
        self.decode = decode
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        self.decode_chunk = decode_chunk
        self.prefill_tokens = prefill_tokens
        self.capacity = slot_capacity(self.max_total_tokens, decode_chunk)
        on_cuda = next(model.parameters()).device.type == "cuda"
        self.view = DecoderView(model, self.capacity, compile=on_cuda if compile is None else compile)
        self.device = self.view.device
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        probe = torch.empty(1, 1, 1, self.view.head_dim, device=self.device)
        self.kernel_attention = triton_ready(probe)
        per_token = 2 * len(self.view.layers) * self.view.kv_heads * self.view.head_dim * self.view.dtype.itemsize
        too_big = cache_fits(per_token * max_batch_size * self.capacity, self.device)
        if too_big:
            raise MemoryError(f"the fast engine's KV cache ({max_batch_size} slots of {self.capacity} tokens) does not "
                              f"fit: {too_big}. Lower rollout.max_batch_size or rollout.max_total_tokens, or use "
                              "rollout.engine = \"hf\".")
        self.cache = self.view.new_cache(max_batch_size, self.capacity)
        self.table = SlotTable(max_batch_size)
        slots, dev = max_batch_size, self.device
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
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._version = 0
        self._request_seeds = random.Random(seed)
        self._queue: collections.deque[_Request] = collections.deque()
        self._rows: dict[int, _Row] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.stats = {"requests": 0, "prefill_tokens": 0, "reused_tokens": 0, "decode_steps": 0, "chunks": 0,
                      "graphs": 0, "capture_seconds": 0.0, "generate_seconds": 0.0, "cache_bytes": self.cache.nbytes}

    # -- weights -------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    def load_weights(self, state_dict, *, version: int, partial: bool = False) -> None:
        """Copy new weights in place (captured graphs stay valid); forget every parked slot."""
        with self._lock:
            if self._rows:
                raise RuntimeError("load_weights while completions are being sampled: wait for the rollout to end")
            copy_weights(self.model, state_dict, partial=partial)
            for slot in list(self.table.parked):
                self.table.release(slot)
            self._version = int(version)

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        validate_request(prompt_ids, params, self.decode)
        if self._closed:
            raise RuntimeError("the engine is closed")
        if len(prompt_ids) >= self.max_total_tokens:
            return Completion([], [], "length", self._version)
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._request_seeds.randrange(SEED_MODULUS))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._queue.append(_Request(list(prompt_ids), params, future, loop))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="ctxrl-fast-engine", daemon=True)
                self._thread.start()
        self._wake.set()
        return await future

    def close(self) -> None:
        """Stop the worker thread; requests still waiting fail."""
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- the worker thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        in_flight: _Chunk | None = None
        with torch.no_grad(), attention_kernels(self.device):
            while True:
                with self._lock:
                    closed, waiting = self._closed, len(self._queue)
                if closed:
                    self._fail_all(RuntimeError("the engine was closed"))
                    return
                if not self._rows and not waiting and in_flight is None:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                start = time.perf_counter()
                try:
                    if not self._rows and in_flight is None:
                        self._gather_arrivals(waiting)
                    # The GPU runs chunk k while the host reads chunk k-1's ids and admits arrivals.
                    launched = self._launch_chunk()
                    if in_flight is not None:
                        self._harvest(in_flight)
                    in_flight = launched
                    if waiting:
                        self._admit()
                except Exception as exc:  # noqa: BLE001 - delivered to every request it touched
                    in_flight = None
                    self._fail_all(exc)
                self.stats["generate_seconds"] += time.perf_counter() - start

    def _gather_arrivals(self, seen: int) -> None:
        """From idle, let the episodes that are about to ask (all woken by one event) join the first batch."""
        for _ in range(20):
            time.sleep(0.0005)
            with self._lock:
                now = len(self._queue)
            if now == seen:
                return
            seen = now

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            waiting = list(self._queue)
            self._queue.clear()
        for slot, row in list(self._rows.items()):
            self.table.release(slot)
            self._deliver(row.request, None, error)
        self._rows.clear()
        for request in waiting:
            self._deliver(request, None, error)

    @staticmethod
    def _deliver(request: _Request, value, error: BaseException | None) -> None:
        try:
            request.loop.call_soon_threadsafe(_resolve, request.future, value, error)
        except RuntimeError:  # the caller's event loop has closed: nobody is waiting
            pass

    # -- admission -----------------------------------------------------------------------------
    def _admit(self) -> None:
        with self._lock:
            waiting = list(self._queue)
            self._queue.clear()
        claimed: dict[int, tuple[int, ...]] = {}
        leaders: list[tuple[_Request, Placement]] = []
        followers: list[tuple[_Request, int, int]] = []  # (request, slot, index of its leader)
        by_prompt: dict[tuple[int, ...], int] = {}
        deferred: list[_Request] = []
        for request in waiting:
            if request.future.cancelled():
                continue
            if deferred:
                deferred.append(request)
                continue
            key = tuple(request.prompt_ids)
            if key in by_prompt:
                placement = self.table.take()
                if placement is None:
                    deferred.append(request)
                    continue
                followers.append((request, placement.slot, by_prompt[key]))
                continue
            placement = self.table.place(request.prompt_ids, claimed)
            if placement is None:
                deferred.append(request)
                continue
            by_prompt[key] = len(leaders)
            leaders.append((request, placement))
        if deferred:
            with self._lock:
                self._queue.extendleft(reversed(deferred))
        if not leaders:
            return
        requests = [r for r, _ in leaders] + [r for r, _, _ in followers]
        slots = [p.slot for _, p in leaders] + [s for _, s, _ in followers]
        try:
            for _, placement in leaders:  # copies read kept prefixes before any prefill overwrites them
                if placement.source is not None:
                    self.cache.copy_prefix(placement.source, placement.slot, placement.cached)
            logits = self._prefill(leaders)
            for request, slot, leader in followers:
                self.cache.copy_prefix(leaders[leader][1].slot, slot, len(request.prompt_ids))
            rows_logits = logits[[i for i in range(len(leaders))] + [leader for _, _, leader in followers]]
            self._start_rows(requests, slots, rows_logits)
        except Exception as exc:  # noqa: BLE001 - this round's requests fail; rows already decoding go on
            for request, slot in zip(requests, slots):
                row = self._rows.get(slot)
                if row is not None and row.request is request:
                    del self._rows[slot]
                if row is None or row.request is request:
                    self.table.release(slot)
                self._deliver(request, None, exc)
            return
        self.stats["reused_tokens"] += sum(p.cached for _, p in leaders)
        self.stats["reused_tokens"] += sum(len(r.prompt_ids) for r, _, _ in followers)

    def _prefill(self, leaders: list[tuple[_Request, Placement]]) -> torch.Tensor:
        """Logits at the last prompt position of each leader; prefills only what its slot lacks."""
        out: list[torch.Tensor] = []
        group: list[tuple[_Request, Placement]] = []
        size = 0
        for item in leaders:
            new = len(item[0].prompt_ids) - item[1].cached
            if group and size + new > self.prefill_tokens:
                out.append(self._prefill_group(group))
                group, size = [], 0
            group.append(item)
            size += new
        out.append(self._prefill_group(group))
        return torch.cat(out)

    def _prefill_group(self, group: list[tuple[_Request, Placement]]) -> torch.Tensor:
        tokens, positions, slots, row_of, offset, last = [], [], [], [], [], []
        width = 0
        for index, (request, placement) in enumerate(group):
            new = request.prompt_ids[placement.cached:]
            tokens += new
            positions += range(placement.cached, len(request.prompt_ids))
            slots += [placement.slot] * len(new)
            row_of += [index] * len(new)
            offset += range(len(new))
            last.append(len(tokens) - 1)
            width = max(width, len(new))
        longest = max(len(r.prompt_ids) for r, _ in group)
        dev = self.device

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=dev)

        batch = Batch(tokens=tensor(tokens), positions=tensor(positions), slots=tensor(slots),
                      rows=tensor([p.slot for _, p in group]), row_of=tensor(row_of), offset=tensor(offset),
                      width=width, n_rows=len(group), key_len=_bucket(longest, 64, self.capacity))
        self.stats["prefill_tokens"] += len(tokens)
        return self.view.forward(batch, self.cache, last=tensor(last))

    def _start_rows(self, requests: list[_Request], slots: list[int], logits: torch.Tensor) -> None:
        params = [r.params for r in requests]
        dev = self.device
        index = torch.tensor(slots, dtype=torch.long, device=dev)
        seeds = torch.tensor([p.seed % SEED_MODULUS for p in params], dtype=torch.long, device=dev)
        temp = torch.tensor([[p.temperature if p.temperature > 0 else 1.0] for p in params], device=dev)
        greedy = torch.tensor([p.temperature <= 0 for p in params], device=dev)
        top_p = torch.tensor([[p.top_p] for p in params], device=dev)
        token, logprob = draw(logits, temp, greedy, seeds, 0, [p.top_k for p in params], top_p)
        self._tok[index] = token
        self._pos[index] = torch.tensor([len(r.prompt_ids) for r in requests], dtype=torch.long, device=dev)
        self._steps[index] = 1
        self._seeds[index] = seeds
        self._temp[index] = temp
        self._greedy[index] = greedy
        for request, slot, tok, lp in zip(requests, slots, token.tolist(), logprob.tolist()):
            self.stats["requests"] += 1
            p = request.params
            row = _Row(request, budget=min(p.max_new_tokens, self.max_total_tokens - len(request.prompt_ids)),
                       stops=frozenset(p.stop_ids), stop_strings=StopStrings(p.stop_strings, self.decode),
                       version=self._version)
            self._rows[slot] = row
            reason = row.add(tok, lp)
            if reason is not None:
                self._finish(slot, reason)

    def _finish(self, slot: int, reason: str) -> None:
        row = self._rows.pop(slot)
        # The slot holds keys and values for the prompt and every sampled id but the last.
        self.table.park(slot, row.request.prompt_ids + row.sampled[:-1])
        completion = Completion(row.sampled, row.logprobs, reason, row.version)
        self._deliver(row.request, completion, None)

    # -- decode ----------------------------------------------------------------------------------
    def _launch_chunk(self) -> _Chunk | None:
        """Queue up to ``decode_chunk`` decode steps for the rows with budget left; copy their outputs to the host."""
        live = {slot: row for slot, row in self._rows.items() if row.left > 0}
        if not live:
            return None
        n = _bucket(self.table.high, 1, self.max_batch_size)
        steps = min(self.decode_chunk, max(row.left for row in live.values()))
        furthest = max(row.position + row.in_flight for row in live.values()) + steps + 1
        key_len = self.capacity if self.kernel_attention else _bucket(furthest, 64, self.capacity)
        truncated = any(r.request.params.top_k > 0 or r.request.params.top_p < 1.0 for r in live.values())
        self._col.zero_()
        graph = self._graph(n, key_len) if self.cuda_graphs and not truncated else None
        for _ in range(steps):
            if graph is not None:
                graph.replay()
            else:
                self._step(n, key_len, truncated)
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
        return _Chunk(live, steps, buffer, done)

    def _harvest(self, chunk: _Chunk) -> None:
        """Read a chunk's ids and log-probs; end the rows that stopped (later ids of theirs are dropped)."""
        if chunk.done is not None:
            chunk.done.synchronize()
        tokens, logprobs = chunk.buffer[0], chunk.buffer[1]
        for slot, row in sorted(chunk.rows.items()):
            row.in_flight -= chunk.steps
            if self._rows.get(slot) is not row:  # ended in an earlier chunk; these ids ran past its end
                continue
            if row.request.future.cancelled():
                self._rows.pop(slot)
                self.table.park(slot, row.request.prompt_ids + row.sampled[:-1])
                continue
            for tok, lp in zip(tokens[slot, : chunk.steps].tolist(), logprobs[slot, : chunk.steps].tolist()):
                reason = row.add(tok, lp)
                if reason is not None:
                    self._finish(slot, reason)
                    break

    def _step(self, n: int, key_len: int, truncated: bool = False) -> None:
        """One decode step for slots ``0..n``: forward, sample, record, advance. No host sync unless truncated."""
        batch = Batch(tokens=self._tok[:n], positions=self._pos[:n], slots=self._arange[:n], rows=None,
                      row_of=None, offset=None, width=1, n_rows=n, key_len=key_len)
        logits = self.view.forward(batch, self.cache)
        top_k = top_p = None
        if truncated:
            params = [self._rows[s].request.params if s in self._rows else None for s in range(n)]
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

    def _graph(self, n: int, key_len: int) -> torch.cuda.CUDAGraph | None:
        """The captured decode step for ``n`` rows (``None``, and eager steps from now on, if capture fails)."""
        graph = self._graphs.get((n, key_len))
        if graph is not None:
            return graph
        try:
            return self._capture(n, key_len)
        except Exception as exc:  # noqa: BLE001 - slower, same numbers
            log.warning("fast engine: CUDA graph capture failed (%s); decoding without graphs", exc)
            self.cuda_graphs = False
            return None

    def _capture(self, n: int, key_len: int) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        state = [self._tok, self._pos, self._steps, self._col]
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (lazy initialisation happens outside the capture)
            self._step(n, key_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(n, key_len)
        for t, s in zip(state, saved):
            t.copy_(s)
        self._graphs[(n, key_len)] = graph
        self.stats["graphs"] += 1
        self.stats["capture_seconds"] += time.perf_counter() - start
        return graph
