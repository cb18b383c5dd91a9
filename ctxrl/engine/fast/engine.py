"""``FastEngine``: continuous batching over a slot KV cache, decode steps in CUDA graphs, prefix reuse.

The same ``Engine`` protocol as ``HFEngine`` (which stays the CPU and reference implementation);
the same sampling maths, seeded per request and token, so a request samples the same ids alone
or beside others, in either engine up to floating-point differences in the logits.

How a request goes through it (one long-lived worker thread does all GPU work; this class is
that thread's loop and the protocol's front, and each stage is a module of its own):

1. **Admission.** Between decode chunks, waiting requests take slots (``admission``, over the
   ``SlotTable`` of ``slots``): an episode's next turn takes the slot its last turn left parked
   and prefills only the new tail (the observation); the samples of a GRPO group, which share
   their prompt, prefill it once and copy its keys and values into their own slots. New tokens of
   all admitted requests are prefilled together, packed without padding (``prefill``). The first
   token is sampled from the prefill's logits (``decode.Decoder.start``).
2. **Decode.** Every active row advances one token per step: forward, sampling, log-prob,
   the position and step counters, all on the GPU (``decode``). On CUDA one step is a captured
   graph per (batch bucket, cache-length bucket) (``graphs``); ``decode_chunk`` steps run per
   visit of the host.
3. **Harvest.** After a chunk the host reads the chunk's ids and log-probs (one transfer) and
   finds each row's end: a stop id, a stop string, or its budget (``rows.Row.add``). Tokens a row
   sampled after its end are dropped (its draws depend only on its own seed and step, so nothing
   else changes), and its slot is parked with the ids whose keys and values it holds.

``load_weights`` copies new weights into the model in place, so captured graphs stay valid, and
forgets every parked slot: keys and values computed by old weights are never reused.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import threading
import time

import torch

from ctxrl.engine.base import Completion, SamplingParams
from ctxrl.engine.capacity import DECODE_CHUNK, PREFILL_TOKENS, cache_fits, slot_capacity
from ctxrl.engine.fast.admission import plan_round
from ctxrl.engine.fast.attention import triton_ready
from ctxrl.engine.fast.decode import Chunk, Decoder
from ctxrl.engine.fast.model import DecoderView, unsupported_reason
from ctxrl.engine.fast.prefill import prefill_round
from ctxrl.engine.fast.rows import Request, Row, deliver
from ctxrl.engine.fast.slots import SlotTable
from ctxrl.engine.hf import copy_weights, validate_request
from ctxrl.models.kernels import attention_kernels
from ctxrl.seeds import SEED_MODULUS

DEFAULT_MAX_TOTAL_TOKENS = 4096
"""Cache length per slot when neither ``max_total_tokens`` nor a shorter model limit says otherwise."""


class UnsupportedModel(ValueError):
    """The fast engine cannot run this model (``HFEngine`` can)."""


class FastEngine:
    """Continuous-batching engine for Llama-layout models; see the module docstring."""

    def __init__(self, model, *, pad_token_id: int, max_batch_size: int = 64, seed: int = 0,
                 max_total_tokens: int | None = None, decode=None, decode_chunk: int = DECODE_CHUNK,
                 prefill_tokens: int = PREFILL_TOKENS, cuda_graphs: bool | None = None,
                 compile: bool | None = None, fuse: bool = True) -> None:
        """``fuse``: q/k/v and gate/up as one product each and, on CUDA, the rotary positions and the cache write as
        one kernel (``fast.model``); off, the modules' own products and the unfused steps (a benchmark's baseline).
        The engine takes ``model`` over: with ``fuse`` its projections' parameters become views of joined
        tensors."""
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
        self.view = DecoderView(model, self.capacity, compile=on_cuda if compile is None else compile, join=fuse,
                                fuse_kv_write=fuse)
        self.device = self.view.device
        self.kernel_attention = triton_ready(torch.empty(1, 1, 1, self.view.head_dim, device=self.device))
        too_big = cache_fits(self.view.cache_bytes(max_batch_size, self.capacity), self.device)
        if too_big:
            raise MemoryError(f"the fast engine's KV cache ({max_batch_size} slots of {self.capacity} tokens) does not "
                              f"fit: {too_big}. Lower rollout.max_batch_size or rollout.max_total_tokens, or use "
                              "rollout.engine = \"hf\".")
        self.cache = self.view.new_cache(max_batch_size, self.capacity)
        self.table = SlotTable(max_batch_size)
        self.stats = {"requests": 0, "prefill_tokens": 0, "reused_tokens": 0, "decode_steps": 0, "chunks": 0,
                      "admission_rounds": 0, "prefill_forwards": 0,
                      "graphs": 0, "capture_seconds": 0.0, "generate_seconds": 0.0, "cache_bytes": self.cache.nbytes}
        self.decoder = Decoder(self.view, self.cache, slots=max_batch_size, decode_chunk=decode_chunk,
                               kernel_attention=self.kernel_attention, stats=self.stats,
                               cuda_graphs=self.device.type == "cuda" if cuda_graphs is None else cuda_graphs)
        self._version = 0
        self._request_seeds = random.Random(seed)
        self._queue: collections.deque[Request] = collections.deque()
        self._rows: dict[int, Row] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay captured CUDA graphs (off for good once a capture fails)."""
        return self.decoder.graphs.enabled

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
            self._queue.append(Request(list(prompt_ids), params, future, loop))
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
        in_flight: Chunk | None = None
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
                    launched = self.decoder.launch(self._rows, self.table.high)
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
            deliver(row.request, None, error)
        self._rows.clear()
        for request in waiting:
            deliver(request, None, error)

    # -- admission, between decode chunks ---------------------------------------------------------------
    def _admit(self) -> None:
        """Start the waiting requests that find a slot (``admission``): prefill them, draw their first tokens."""
        with self._lock:
            waiting = list(self._queue)
            self._queue.clear()
        round_ = plan_round(waiting, self.table)
        if round_.deferred:
            with self._lock:
                self._queue.extendleft(reversed(round_.deferred))
        if not round_.leaders:
            return
        self.stats["admission_rounds"] += 1
        requests, slots = round_.requests, round_.slots
        try:
            logits = prefill_round(round_, self.view, self.cache, prefill_tokens=self.prefill_tokens,
                                   stats=self.stats)
            self._start_rows(requests, slots, logits)
        except Exception as exc:  # noqa: BLE001 - this round's requests fail; rows already decoding go on
            for request, slot in zip(requests, slots):
                row = self._rows.get(slot)
                if row is not None and row.request is request:
                    del self._rows[slot]
                if row is None or row.request is request:
                    self.table.release(slot)
                deliver(request, None, exc)
            return
        self.stats["reused_tokens"] += round_.reused

    def _start_rows(self, requests: list[Request], slots: list[int], logits: torch.Tensor) -> None:
        tokens, logprobs = self.decoder.start(slots, [r.params for r in requests],
                                              [len(r.prompt_ids) for r in requests], logits)
        for request, slot, tok, lp in zip(requests, slots, tokens, logprobs):
            self.stats["requests"] += 1
            row = Row.start(request, max_total_tokens=self.max_total_tokens, decode=self.decode,
                            version=self._version)
            self._rows[slot] = row
            reason = row.add(tok, lp)
            if reason is not None:
                self._finish(slot, reason)

    # -- harvest: the host reads a chunk's ids -----------------------------------------------------------
    def _harvest(self, chunk: Chunk) -> None:
        """Read a chunk's ids and log-probs; end the rows that stopped (later ids of theirs are dropped)."""
        chunk.wait()
        for slot, row in sorted(chunk.rows.items()):
            row.in_flight -= chunk.steps
            if self._rows.get(slot) is not row:  # ended in an earlier chunk; these ids ran past its end
                continue
            if row.request.future.cancelled():
                self._rows.pop(slot)
                self.table.park(slot, row.kept_ids)
                continue
            for tok, lp in chunk.outputs(slot):
                reason = row.add(tok, lp)
                if reason is not None:
                    self._finish(slot, reason)
                    break

    def _finish(self, slot: int, reason: str) -> None:
        row = self._rows.pop(slot)
        # Parked before the answer goes out: once every answer is in, a caller may load new weights, which forgets
        # every parked slot; a slot parked after that would offer keys computed by the old weights.
        self.table.park(slot, row.kept_ids)  # the slot's keys and values, kept for a later turn to extend
        deliver(row.request, row.completion(reason), None)
