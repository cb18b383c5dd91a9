"""The ``Engine`` protocol: prompt ids in, sampled ids with their log-probabilities out; new weights in.

Anything that satisfies it can drive rollouts: the in-process ``HFEngine`` today; a remote
OpenAI-compatible server (vLLM, SGLang) later. Plain data in and out, so it can cross a
process boundary. An engine owns the weights it samples with: the learner trains its own copy
and hands the result over with ``load_weights(state, version=...)`` after each optimiser step;
``policy_version`` says which weights produced a completion (it is stamped on every episode).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

PURPOSES: list[str] = ["turn", "summary", "reflection"]
"""What a generation may be asked for; a context manager with a side request of its own adds it
(``register_purpose``), so that a misspelt purpose is an error, not a silent new one."""


def register_purpose(name: str) -> None:
    """Allow ``SamplingParams(purpose=name)`` (a context manager's side request)."""
    if name not in PURPOSES:
        PURPOSES.append(name)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    ``temperature <= 0`` means greedy. ``top_k = 0`` and ``top_p = 1.0`` disable truncation.
    Generation stops after a token in ``stop_ids`` (which is kept in the output, as the model
    sampled it), once the sampled text contains one of ``stop_strings`` (the tokens that wrote it
    are kept too), or after ``max_new_tokens``. ``seed`` fixes the random draws of this one
    completion, whatever else the engine is serving at the time; ``None`` lets the engine pick
    one from its own seeded stream (reproducible only if requests arrive in the same order).

    ``purpose`` says what the agent loop asks for: ``turn`` (an action turn) or a side request, such
    as ``summary`` (the ``summarize`` context manager's summary of the episode so far) or
    ``reflection`` (the meta loop's reflection on a finished attempt, ``ctxrl.meta.rollout``).
    Sampling engines sample them all alike; a scripted engine answers a side request with a
    scripted text instead of its next turn, so demonstrations never have to guess from the
    prompt's text which one is asked for.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_ids: tuple[int, ...] = field(default_factory=tuple)
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    purpose: str = "turn"

    def __post_init__(self) -> None:
        if self.purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}, got {self.purpose!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings holds an empty string, which would stop every completion at once")


@dataclass
class Completion:
    """Sampled ids, their behaviour log-probs, why sampling stopped, and the policy version."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """``stop``: the last id is a stop id (an end-of-turn token); ``stop_string``: the sampled text reached one of
    the stop strings (the last id is ordinary text); ``length``: cut off at ``max_new_tokens``."""
    policy_version: int = 0

    @property
    def closed(self) -> bool:
        """Whether the completion ends with a stop id (its end-of-turn token)."""
        return self.finish_reason == "stop"

    @property
    def truncated(self) -> bool:
        """Whether it was cut off at its token limit before it ended."""
        return self.finish_reason == "length"


@runtime_checkable
class Engine(Protocol):
    @property
    def policy_version(self) -> int:
        """The version of the weights the next completion samples with."""
        ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Sample one completion of ``prompt_ids``."""
        ...

    def load_weights(self, state: Mapping[str, Any], *, version: int) -> None:
        """Replace the engine's weights (a state dict by parameter name) and set the policy version.

        An engine that can take only the tensors that changed (a LoRA run's adapters) accepts
        ``partial=True`` as well."""
        ...
