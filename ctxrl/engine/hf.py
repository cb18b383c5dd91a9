"""``HFEngine``: batched sampling from a HF causal LM, in-process, on CPU or CUDA.

Many episodes call ``await engine.generate(prompt_ids, params)`` concurrently. A single worker
collects the requests that are waiting, left-pads them into one batch, runs one prefill and a
token-by-token decode loop over a KV cache, and resolves each request with its sampled ids and
their log-probabilities. The forward passes run in the engine's own worker thread (one, for
the engine's lifetime) so the event loop keeps serving tools and timers meanwhile.

Two measured GPU pitfalls shape this (``benchmarks/engine_throughput.py``, H200, Qwen2-0.5B
shape, bf16): PyTorch's cuDNN attention backend builds an execution plan per new tensor shape
and per thread, about 2 ms per attention call, and a decode loop has a new key length every
step; and a fresh thread per batch (what ``asyncio.to_thread`` gives under a new event loop)
loses every per-thread cache. Decoding on CUDA therefore runs with the flash / memory-efficient
/ math attention backends only, in one long-lived thread.

What it is: static batching (a batch runs until its last row stops; requests that arrive
meanwhile form the next batch). What it is not: continuous batching or paged attention — for
those, serve the policy with vLLM/SGLang behind the same ``Engine`` protocol.

Log-probabilities are those of the distribution each token was drawn from: the temperature-scaled
logits after top-k, then top-p (``log_softmax(filter(logits / T))``), so they are the behaviour
policy's own. Without truncation (``top_k = 0``, ``top_p = 1``, the training default) that is
exactly what the learner computes (``log_softmax(logits / T)``). With truncation the learner's
untruncated log-prob of a kept token is lower by ``-log(kept mass)``, so the PPO ratio of such a
token starts below 1; ``algo.old_logprobs = "recompute"`` with ``algo.tis_cap`` corrects for it
(the weight ``exp(learner - behaviour)`` is the kept mass). Greedy decoding (T = 0) reports the
log-prob under T = 1 without truncation.

Stops: a request ends when it samples one of its ``stop_ids`` (finish ``stop``), when its
sampled text contains one of its ``stop_strings`` (finish ``stop_string``; the engine needs a
``decode`` function for these), or at its token budget (``length``).

The engine owns its module: the trainer gives it a copy of the policy and, after every optimiser
step, copies the new weights in with ``load_weights(state_dict, version=step + 1)`` in memory,
without a disk round trip (each tensor is cast to the engine's dtype, so an engine may keep its
copy in another dtype than the learner's). Nothing else
writes to the engine's weights, so a rollout never sees a half-updated model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ctxrl.engine.base import Completion, SamplingParams
from ctxrl.engine.sampling import draw
from ctxrl.models.kernels import attention_kernels
from ctxrl.seeds import SEED_MODULUS


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future = field(repr=False)


class HFEngine:
    """Batched in-process generation; see the module docstring."""

    def __init__(self, model, *, pad_token_id: int, max_batch_size: int = 64, seed: int = 0,
                 max_total_tokens: int | None = None, decode: Callable[[list[int]], str] | None = None) -> None:
        self.model = model
        self.decode = decode
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens or int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._version = 0
        self._seeds = random.Random(seed)  # request seeds for requests that bring none
        self._pending: list[_Request] = []
        self._worker: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # (a PEFT model passes it on)
        self._cache_kw = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
        self._executor: ThreadPoolExecutor | None = None
        self.stats = {"batches": 0, "requests": 0, "forward_passes": 0, "generate_seconds": 0.0}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- weights -----------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The version of the weights the engine samples with (0 before any ``load_weights``)."""
        return self._version

    def load_weights(self, state_dict: dict[str, torch.Tensor], *, version: int, partial: bool = False) -> None:
        """Copy new weights into the engine's model in memory (cast to its dtype) and set the policy version.

        ``partial``: ``state_dict`` holds only the tensors that changed (a LoRA run's adapters); the rest
        stay as they are. Every name given must be one of the engine's either way.
        """
        copy_weights(self.model, state_dict, partial=partial)
        self._version = int(version)

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        validate_request(prompt_ids, params, self.decode)
        if len(prompt_ids) >= self.max_total_tokens:
            return Completion([], [], "length", self._version)
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._wakeup = asyncio.Event()
            self._pending = []
            self._worker = loop.create_task(self._serve())
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._seeds.randrange(SEED_MODULUS))
        future = loop.create_future()
        self._pending.append(_Request(list(prompt_ids), params, future))
        self._wakeup.set()
        return await future

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            # Let every episode that is about to ask join this batch.
            seen = -1
            while seen != len(self._pending):
                seen = len(self._pending)
                for _ in range(3):
                    await asyncio.sleep(0)
            batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size:]
            if not self._pending:
                self._wakeup.clear()
            batch = [r for r in batch if not r.future.cancelled()]
            if not batch:
                continue
            try:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxrl-engine")
                results = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._generate_batch, [(r.prompt_ids, r.params) for r in batch])
            except Exception as exc:  # noqa: BLE001 - delivered to every waiting episode
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            for r, completion in zip(batch, results):
                if not r.future.done():
                    r.future.set_result(completion)

    def close(self) -> None:
        """Stop the worker thread (a later ``generate`` starts a new one)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- the batched decode loop ------------------------------------------------------------------
    @torch.no_grad()
    def _generate_batch(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Completion]:
        start = time.perf_counter()
        model, device = self.model, self.device
        was_training = model.training
        model.eval()
        try:
            with attention_kernels(device):
                out = self._decode(requests, model, device)
        finally:
            model.train(was_training)
        self.stats["batches"] += 1
        self.stats["requests"] += len(requests)
        self.stats["generate_seconds"] += time.perf_counter() - start
        return out

    def _decode(self, requests, model, device) -> list[Completion]:
        batch = len(requests)
        lengths = [len(p) for p, _ in requests]
        width = max(lengths)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, (prompt, _) in enumerate(requests):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention[row, width - len(prompt):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)

        params = [p for _, p in requests]
        budgets = [min(p.max_new_tokens, self.max_total_tokens - n) for p, n in zip(params, lengths)]
        temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                                   device=device).unsqueeze(-1)
        greedy = torch.tensor([p.temperature <= 0 for p in params], device=device)
        top_k = [p.top_k for p in params]
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(-1)
        stops = [set(p.stop_ids) for p in params]
        stop_strings = [StopStrings(p.stop_strings, self.decode) for p in params]
        seeds = torch.tensor([p.seed % SEED_MODULUS for p in params], dtype=torch.long)

        sampled: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish: list[str | None] = [None if b > 0 else "length" for b in budgets]

        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        kwargs = {self._cache_kw: cache, "use_cache": True}
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                       logits_to_keep=1, **kwargs).logits[:, -1, :].float()
        self.stats["forward_passes"] += 1
        next_pos = positions[:, -1:] + 1
        for step in range(max(budgets)):
            # Greedy rows report the untruncated T=1 log-prob; sampled rows that of the distribution drawn from.
            choice, chosen_lp = draw(logits, temperature, greedy, seeds, step, top_k, top_p)
            ids, lps = choice.tolist(), chosen_lp.tolist()
            for row in range(batch):
                if finish[row] is not None:
                    continue
                sampled[row].append(ids[row])
                logprobs[row].append(lps[row])
                if ids[row] in stops[row]:
                    finish[row] = "stop"
                elif stop_strings[row].reached(sampled[row]):
                    finish[row] = "stop_string"
                elif len(sampled[row]) >= budgets[row]:
                    finish[row] = "length"
            if all(f is not None for f in finish):
                break
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], -1)
            logits = model(input_ids=choice.unsqueeze(-1), attention_mask=attention, position_ids=next_pos,
                           **kwargs).logits[:, -1, :].float()
            self.stats["forward_passes"] += 1
            next_pos = next_pos + 1
        return [Completion(sampled[r], logprobs[r], finish[r] or "length", self._version) for r in range(batch)]


def validate_request(prompt_ids: list[int], params: SamplingParams, decode) -> None:
    """The checks every engine makes before queueing a request."""
    if not prompt_ids:
        raise ValueError("generate: prompt_ids is empty")
    if params.stop_strings and decode is None:
        raise ValueError("generate: stop_strings need the engine's decode function (Engine(..., decode=...))")


def copy_weights(model: torch.nn.Module, state_dict, *, partial: bool = False) -> None:
    """Copy ``state_dict`` into ``model``'s tensors in place, each cast to the tensor's device and dtype.

    In full mode every tensor ``model.state_dict()`` names must be given, by any of its names (a tied
    tensor such as ``lm_head`` = ``embed_tokens`` needs one; non-persistent buffers such as rotary
    frequencies are not in it). ``partial``: only the tensors given change, and each name must exist.
    """
    own = model.state_dict(keep_vars=True)
    if partial:
        unknown = [name for name in state_dict if name not in own]
        if unknown:
            raise KeyError(f"load_weights: the engine's model has no tensors {unknown[:3]} "
                           f"({len(unknown)} unknown names)")
        with torch.no_grad():
            for name, value in state_dict.items():
                own[name].copy_(value.to(own[name].device, own[name].dtype))
        return
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in own.items():
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    sources = {key: next((n for n in aliases if n in state_dict), None) for key, aliases in names.items()}
    missing = [names[key][0] for key, source in sources.items() if source is None]
    if missing:
        raise KeyError(f"load_weights: state dict lacks {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for key, source in sources.items():
            tensors[key].copy_(state_dict[source].to(tensors[key].device, tensors[key].dtype))


class StopStrings:
    """Whether a row's sampled ids have written one of its stop strings.

    Only the tail is decoded each step: a stop string of ``n`` characters was completed within the
    last ``2n + 4`` tokens (a byte-level token can hold part of a character), so the check costs
    the same at token 10 and token 4000.
    """

    def __init__(self, strings: tuple[str, ...], decode: Callable[[list[int]], str] | None) -> None:
        self.strings = strings
        self.decode = decode
        self.window = 2 * max((len(s) for s in strings), default=0) + 4

    def reached(self, ids: list[int]) -> bool:
        if not self.strings:
            return False
        tail = self.decode(ids[-self.window:])
        return any(s in tail for s in self.strings)
