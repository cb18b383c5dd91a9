"""Plain data that crosses every boundary in ctxrl: tasks, messages, tool calls, episodes.

Everything here is a dataclass of JSON-friendly fields, so it can cross a process boundary
unchanged: ``to_dict`` / ``from_dict`` (and ``ctxrl.plain.to_json`` / ``from_json``) round-trip
every field exactly, floats included. Nothing here imports torch: tensors are built from these
lists by the learner, never stored in them. Ids, masks and log-probs are written by one piece of
code only, the rollout's ``Recorder`` (``ctxrl.rollout.recorder``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxrl.plain import PlainData

SPLITS = ("train", "heldout", "ood")
MAX_ABS_REWARD = 1e6
"""The largest reward, either way, an episode may carry, from an environment, a harness or a client: past it the
learner's float32 arithmetic loses the episode's signal (1e308 is finite in float64 and infinite in float32), so a
larger one errors the episode (``ctxrl.rollout.agent``) or is a 400 (``ctxrl serve``)."""


@dataclass
class ToolCall(PlainData):
    """One parsed tool call: the tool's name and its arguments, whatever format the model wrote it in.

    ``id`` is the tool-call id the model wrote with the call (Mistral's v3 layout), else None; the
    renderer gives the template a deterministic one where the template needs it (``ctxrl.chat.render``).
    """

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass
class Message(PlainData):
    """A chat message.

    ``tool_calls`` holds calls parsed from an assistant message (its ``content`` keeps the raw
    sampled text, calls included); ``tool_call_errors`` holds one human-readable error per
    malformed call (the episode continues and the error is shown to the model as an
    observation). ``name`` is the tool name on tool messages, ``tool_call_id`` the id of the call
    a tool message answers when it is known (the renderer fills it in for templates otherwise).
    """

    role: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_errors: list[str] = field(default_factory=list)
    name: str | None = None
    tool_call_id: str | None = None

    def to_chat(self) -> dict[str, Any]:
        """The dict a HF chat template expects (the OpenAI layout)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {**({"id": c.id} if c.id is not None else {}), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass
class Task(PlainData):
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


@dataclass
class StepResult(PlainData):
    """What ``Env.step`` returns: new messages to show the model, and the reward so far."""

    messages: list[Message]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class TableStep(PlainData):
    """What a multi-role environment's ``step`` returns (``ctxrl.envs.roles``): the single-agent ``StepResult``
    per seat.

    ``messages[seat]``: what each seat reads before its next turn; ``rewards[seat]``: what each seat earned by
    this step (a seat left out earned 0); ``outcome[seat]``: whether the seat won or solved, once the match ends;
    ``info``: about the acting seat's turn, as ``StepResult.info``.
    """

    messages: dict[str, list[Message]] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, bool] = field(default_factory=dict)


@dataclass
class Turn(PlainData):
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
    policy_version: int = 0
    """The version of the weights that sampled this turn (``Completion.policy_version``). The turns of one episode
    differ only in a partial rollout, where an episode cut at a weight update goes on with the new weights
    (``ctxrl.rollout.partial``); ``turn_versions`` gives each sampled token its turn's."""


@dataclass
class Segment(PlainData):
    """One closed, token-faithful sequence of an episode whose context was rewritten (e.g. summarised).

    Same invariants as ``Episode``'s own arrays; ``messages`` is the conversation it rendered, and
    ``ended_by`` says what closed it (``summary``, ``window``, ``fold``, ``attempt``, ``reflection``,
    ``template`` (a chat template that rewrites earlier turns, ``ctxrl.chat.render``); ``end`` for the
    live sequence ``Episode.sequences()`` lists last).
    """

    input_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    turn_index: list[int]
    messages: list[Message] = field(default_factory=list)
    ended_by: str = "summary"


def environment_mask(sequence: Episode | Segment) -> list[int]:
    """1 on each token the environment wrote into ``sequence``, 0 elsewhere: what the ``Recorder`` appended after a
    turn without sampling it (``observe``: tool output and the environment's replies, rendered with their template
    tokens, and a scripted player's moves), read from the arrays it wrote: mask 0 with the index of the turn it
    answers (>= 0). The prompt (turn -1, re-rendered prompts included) and every sampled token are 0."""
    return [int(m == 0 and t >= 0) for m, t in zip(sequence.loss_mask, sequence.turn_index)]


def turn_versions(episode: Episode) -> list[int]:
    """The policy version of every sampled token of ``episode`` (mask 1), sequence by sequence (``sequences()``), in
    order: the version of the turn it belongs to (``turn_index``). A side generation (a summary) samples between its
    turn and the next, on its turn's weights: a partial rollout never cuts an episode there."""
    versions = {turn.index: turn.policy_version for turn in episode.turns}
    out = []
    for sequence in episode.sequences():
        for mask, turn in zip(sequence.loss_mask, sequence.turn_index):
            if mask:
                if turn not in versions:
                    raise ValueError(f"a sampled token of turn {turn} has no Turn record in the episode of task "
                                     f"{episode.task.id}: its policy version is unknown")
                out.append(versions[turn])
    return out


@dataclass
class Episode(PlainData):
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
    role: str = ""
    """The role of the seat this episode records in a multi-role match (``ctxrl.rollout.match``); "" for a
    single-agent episode, the one role."""

    @property
    def baseline_group(self) -> tuple[int, str]:
        """What group statistics compare this episode with: the episodes of its task group that play its role."""
        return self.group_id, self.role

    def sequences(self) -> list[Segment]:
        """Every sequence the learner trains on: the closed segments, then the live one."""
        live = Segment(self.input_ids, self.loss_mask, self.behavior_logprobs, self.turn_index, self.messages, "end")
        return [*self.segments, live]

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask) + sum(sum(s.loss_mask) for s in self.segments)

    @property
    def tool_calls(self) -> int:
        return sum(t.tool_calls for t in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(t.tool_errors for t in self.turns)



@dataclass
class TrainSequence(PlainData):
    """One row the learner trains on: a token-faithful sequence and its per-token targets.

    Built by an advantage estimator from an episode (one per episode, or one per segment or
    attempt). Every list is aligned with ``input_ids``; ``advantages`` is 0 wherever ``loss_mask``
    is 0. ``returns``, ``old_values`` and ``value_mask`` are the critic's targets (GAE only;
    ``value_mask`` None = train the value at every sampled token). ``teacher_ids`` / ``teacher_probs``: a
    distillation teacher's ``K`` likeliest tokens and their probabilities for each token (``K`` zeros where the
    loss mask is 0; ``algo.distill.top_k``).
    """

    input_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    advantages: list[float]
    returns: list[float] | None = None
    old_values: list[float] | None = None
    value_mask: list[int] | None = None
    group_id: int = 0
    policy_version: int = 0
    teacher_ids: list[list[int]] | None = None
    teacher_probs: list[list[float]] | None = None
    env_mask: list[int] | None = None
    """1 on the tokens the environment wrote (``environment_mask``), for the world-model loss
    (``algo.world_model_coef``); None: unknown (no such token is trained)."""

    @classmethod
    def of(cls, sequence: Episode | Segment, advantages: list[float], **targets: Any) -> TrainSequence:
        """The row of one episode's (or segment's) token arrays with ``advantages`` and optional targets."""
        if len(advantages) != len(sequence.input_ids):
            raise ValueError(f"{len(sequence.input_ids)} tokens but {len(advantages)} advantages")
        targets.setdefault("env_mask", environment_mask(sequence))
        return cls(sequence.input_ids, sequence.loss_mask, sequence.behavior_logprobs, advantages, **targets)
