"""Plain data that crosses every boundary in ctxrl: tasks, messages, tool calls, episodes.

Everything here is a dataclass of JSON-friendly fields (plus ``to_dict``), so it can cross a
process boundary unchanged. Nothing here imports torch: tensors are built from these lists by
the learner, never stored in them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SPLITS = ("train", "heldout", "ood")


@dataclass
class ToolCall:
    """One parsed tool call: ``{"name": ..., "arguments": {...}}`` in the Hermes/Qwen format."""

    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class Message:
    """A chat message.

    ``tool_calls`` holds calls parsed from an assistant message; ``tool_call_errors`` holds one
    human-readable error per malformed ``<tool_call>`` block (the episode continues and the
    error is shown to the model as an observation). ``name`` is the tool name on tool messages.
    """

    role: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_errors: list[str] = field(default_factory=list)
    name: str | None = None

    def to_chat(self) -> dict[str, Any]:
        """The dict a HF chat template expects."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.name is not None:
            out["name"] = self.name
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Task:
    """One problem instance drawn from an environment's context space.

    ``context`` holds the variant parameters it was drawn with (e.g. ``{"digits": 2, "ops": 1}``),
    ``split`` is ``train``, ``heldout`` or ``ood``, ``answer`` is the gold answer as text.
    """

    id: str
    prompt: str
    answer: str
    context: dict[str, Any] = field(default_factory=dict)
    split: str = "train"
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StepResult:
    """What ``Env.step`` returns: new messages to show the model, and the reward so far."""

    messages: list[Message]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    """Bookkeeping for one assistant turn of an episode."""

    index: int
    prompt_tokens: int
    sampled_tokens: int
    finish_reason: str
    text: str
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0
    answered: bool | None = None
    """Whether the environment took this turn as a final answer (its ``info["answered"]``); None if it did not say."""
    reward: float = 0.0


@dataclass
class Segment:
    """One closed, token-faithful sequence of an episode whose context was rewritten (e.g. summarised).

    Same invariants as ``Episode``'s own arrays; ``messages`` is the conversation it rendered, and
    ``ended_by`` says what closed it (``summary``).
    """

    input_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    turn_index: list[int]
    messages: list[Message] = field(default_factory=list)
    ended_by: str = "summary"


@dataclass
class Episode:
    """One token-faithful episode.

    Invariants (tested): ``len(input_ids) == len(loss_mask) == len(behavior_logprobs) ==
    len(turn_index)``; ``loss_mask[i] == 1`` exactly for tokens the policy sampled;
    ``behavior_logprobs[i] == 0.0`` wherever ``loss_mask[i] == 0``; ``turn_index[i]`` is the
    assistant turn a sampled token belongs to and -1 on the initial prompt (observation tokens
    carry the index of the turn they answer).
    """

    task: Task
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    truncation: str | None = None
    policy_version: int = 0
    group_id: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    """Earlier, closed sequences (oldest first); ``input_ids`` etc. hold the live, last one."""

    def start_segment(self, prompt_ids: list[int], messages: list[Message], *, ended_by: str = "summary") -> None:
        """Close the live sequence (kept in ``segments``) and start a new one from ``prompt_ids`` (mask 0)."""
        self.segments.append(Segment(self.input_ids, self.loss_mask, self.behavior_logprobs, self.turn_index,
                                     list(self.messages), ended_by))
        self.input_ids, self.loss_mask, self.behavior_logprobs, self.turn_index = [], [], [], []
        self.messages = list(messages)
        self.append(prompt_ids, sampled=False, turn=-1)

    def sequences(self) -> list[Segment]:
        """Every sequence the learner trains on: the closed segments, then the live one."""
        live = Segment(self.input_ids, self.loss_mask, self.behavior_logprobs, self.turn_index, self.messages, "end")
        return [*self.segments, live]

    def append(self, ids: list[int], *, sampled: bool, turn: int, logprobs: list[float] | None = None) -> None:
        """Append ids; sampled ids carry their behaviour log-probs, others get 0."""
        if sampled:
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError("sampled ids need one behaviour log-prob each")
            self.behavior_logprobs.extend(float(x) for x in logprobs)
        else:
            self.behavior_logprobs.extend([0.0] * len(ids))
        self.input_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.turn_index.extend([turn] * len(ids))

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask) + sum(sum(s.loss_mask) for s in self.segments)

    @property
    def tool_calls(self) -> int:
        return sum(t.tool_calls for t in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(t.tool_errors for t in self.turns)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
