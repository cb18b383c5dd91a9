"""One generation of an episode: its sampling parameters, and side generations (summaries, reflections).

A seeded episode seeds each generation with ``derive_seed(seed, counter)``: turn ``t`` uses
counter ``t``, the side generations their own salts (``ctxrl.seeds``), so an episode samples the
same tokens however the engine batches it with others.

A *side generation* is a request that is not an action turn, answered by the policy and trained:
the ``summarize`` manager's summary and the meta loop's reflection are both one. ``sample_aside``
appends the request (mask 0) after the last assistant message and samples the answer (mask 1),
through the episode's ``Recorder``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Engine, SamplingParams
from ctxrl.rollout.recorder import Recorder
from ctxrl.seeds import derive_seed
from ctxrl.types import Message

if TYPE_CHECKING:
    from ctxrl.rollout.spec import RolloutLimits


def sampling_params(limits: RolloutLimits, renderer: ChatRenderer, max_new_tokens: int, seed: int | None,
                    counter: int, purpose: str = "turn") -> SamplingParams:
    """One generation's sampling settings; a seeded episode seeds it with ``derive_seed(seed, counter)``."""
    return SamplingParams(temperature=limits.temperature, top_p=limits.top_p, top_k=limits.top_k,
                          max_new_tokens=max_new_tokens,
                          stop_ids=tuple(dict.fromkeys((*renderer.end_ids, *limits.stop_ids))),
                          stop_strings=limits.stop_strings,
                          seed=None if seed is None else derive_seed(seed, counter), purpose=purpose)


@dataclass(frozen=True)
class Aside:
    """A side generation's result."""

    text: str
    closed: bool
    """Whether it ended with the end-of-turn token."""
    truncated: bool
    """Whether it was cut off at its token limit (not closed, and no stop string ended it)."""
    start: int
    """Index of its first sampled token in the live sequence."""
    tokens: int
    """How many tokens it sampled."""


async def sample_aside(recorder: Recorder, ask: list[Message], engine: Engine, limits: RolloutLimits, *,
                       max_new_tokens: int, seed: int | None, counter: int, purpose: str, turn: int,
                       ask_turn: int | None = None, closed: bool = True) -> Aside | None:
    """Append ``ask`` (mask 0, turn ``ask_turn``) and sample one side generation (mask 1, turn ``turn``).

    ``closed``: whether the last assistant message ended with its end-of-turn token. None, with
    nothing appended, when the sequence has no room left for it (``limits.max_total_tokens``).
    """
    delta = recorder.observation_ids(ask, closed=closed)
    room = limits.max_total_tokens - recorder.length_after(delta)
    if room <= 0:
        return None
    recorder.observe(ask, delta, turn if ask_turn is None else ask_turn)
    start = len(recorder)
    params = sampling_params(limits, recorder.renderer, min(max_new_tokens, room), seed, counter, purpose=purpose)
    completion = await engine.generate(recorder.ids, params)
    text = recorder.renderer.decode(completion.token_ids[:-1] if completion.closed else completion.token_ids)
    recorder.assistant(completion, Message(role="assistant", content=text), turn)
    return Aside(text, completion.closed, completion.truncated, start, len(completion.token_ids))
