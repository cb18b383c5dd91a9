"""A request's life in the fast engine: waiting (``Request``), decoding (``Row``), answered (``deliver``).

A ``Row`` is the host's record of one request decoding in a slot: the ids and log-probs sampled so
far, its budget and its stops. Stop handling lives here (``Row.add``): the first stop id, stop string
or exhausted budget ends the row, with the finish reason ``HFEngine`` would give. The device's side
of a row (its token, position and seed tensors) is ``decode.Decoder``'s.

Answers cross threads: the engine's worker thread resolves a future of the caller's event loop
through ``call_soon_threadsafe``, never directly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ctxrl.engine.base import Completion, SamplingParams
from ctxrl.engine.hf import StopStrings


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future = field(repr=False)
    loop: asyncio.AbstractEventLoop = field(repr=False)


@dataclass
class Row:
    request: Request
    budget: int
    stops: frozenset[int]
    stop_strings: StopStrings
    version: int
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    in_flight: int = 0
    """Decode steps queued on the device whose ids the host has not read yet."""

    @classmethod
    def start(cls, request: Request, *, max_total_tokens: int, decode, version: int) -> Row:
        """A row for ``request``: its budget is ``max_new_tokens`` or the room left in ``max_total_tokens``."""
        p = request.params
        return cls(request, budget=min(p.max_new_tokens, max_total_tokens - len(request.prompt_ids)),
                   stops=frozenset(p.stop_ids), stop_strings=StopStrings(p.stop_strings, decode), version=version)

    @property
    def left(self) -> int:
        """Steps still worth queueing: the budget not yet sampled or in flight."""
        return self.budget - len(self.sampled) - self.in_flight

    @property
    def position(self) -> int:
        """Position of the token the next decode step feeds (the last sampled one)."""
        return len(self.request.prompt_ids) + len(self.sampled) - 1

    @property
    def kept_ids(self) -> list[int]:
        """The ids whose keys and values the slot holds: the prompt and every sampled id but the last."""
        return self.request.prompt_ids + self.sampled[:-1]

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

    def completion(self, reason: str) -> Completion:
        return Completion(self.sampled, self.logprobs, reason, self.version)


def deliver(request: Request, value, error: BaseException | None) -> None:
    """Resolve ``request``'s future with ``value`` or ``error``, on its caller's event loop."""
    try:
        request.loop.call_soon_threadsafe(_resolve, request.future, value, error)
    except RuntimeError:  # the caller's event loop has closed: nobody is waiting
        pass


def _resolve(future: asyncio.Future, value, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
