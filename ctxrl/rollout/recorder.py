"""The ``Recorder``: the one writer of an episode's tokens.

Every id an episode holds, with its loss mask, behaviour log-prob and turn index, is appended
here, and every segment is opened and closed here; nothing else in ctxrl writes those arrays.
That is what makes the trajectory's invariants (``ctxrl.types.Episode``) checkable in one place:

- ``prompt(messages)``: a fresh prompt, rendered whole (loss mask 0, turn -1); the first thing in
  a live sequence;
- ``assistant(completion, message, turn)``: what the engine sampled (mask 1, with its behaviour
  log-probs) and the parsed message it decodes to;
- ``scripted(completion, message, turn)``: an assistant turn a script wrote, not a policy (a scripted
  opponent's move in a multi-role match, ``ctxrl.rollout.match``): the same ids an engine would have
  sampled for the text, as context (mask 0), since no policy sampled them;
- ``observation_ids(messages)`` then ``observe(messages, ids, turn)``: text the policy did not
  write, rendered *alone* through the chat template and appended (mask 0). The renderer encodes
  its special tokens and tool-call tags as plain text (``ctxrl.chat.guard``), so tool output cannot
  forge a turn boundary, a call or a result. Where the template rewrites history at a new user
  message (Qwen3 drops earlier reasoning), the ids are a ``Rerendered`` fresh prompt of the whole
  conversation instead, and ``observe`` closes the live sequence as a segment (``ended_by="template"``, counted in
  ``info["template_restarts"]``) and starts a new one from them;
- ``restart(messages, ended_by)``: close the live sequence as a ``Segment`` and start a new one
  from ``messages`` (a summary, a window, the next attempt);
- ``open_branch`` / ``close_branch``: pause the live sequence, run another in its place, then close
  that one as a segment and go back (the ``fold`` manager).

The Recorder does not decide anything: what to append and when is the agent loop's and the
context manager's business. It never decodes and re-encodes sampled tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ctxrl.chat.render import ChatRenderer, HistoryRewritten
from ctxrl.engine.base import Completion
from ctxrl.types import Episode, Message, Segment


class Rerendered(list):
    """``observation_ids``' answer where the template rewrote history: the ids of a fresh rendering of the
    whole conversation, observations included, which ``observe`` starts a new segment with."""


@dataclass
class Live:
    """A paused live sequence (``open_branch`` returns it, ``close_branch`` restores it)."""

    input_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    turn_index: list[int]
    messages: list[Message]


class Recorder:
    """Appends to ``episode``'s live sequence; ``tools`` are the schemas its prompts render with."""

    def __init__(self, episode: Episode, renderer: ChatRenderer | None = None, tools: list[dict] | None = None) -> None:
        self.episode = episode
        self.renderer = renderer
        self.tools = tools
        self.closed = not episode.turns or episode.turns[-1].finish_reason == "stop"
        """Whether the last sampled completion ended with its end-of-turn token (``observation_ids``' default)."""

    # -- reading -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Tokens in the live sequence (what the next generation's prompt holds)."""
        return len(self.episode.input_ids)

    @property
    def messages(self) -> list[Message]:
        """The conversation the live sequence renders."""
        return self.episode.messages

    @property
    def ids(self) -> list[int]:
        """A copy of the live sequence's ids: the next generation's prompt."""
        return list(self.episode.input_ids)

    # -- writing -----------------------------------------------------------------------------------
    def prompt(self, messages: list[Message]) -> None:
        """Start the (empty) live sequence with ``messages`` rendered as a fresh prompt (mask 0, turn -1)."""
        if self.episode.input_ids:
            raise RuntimeError("Recorder.prompt starts a sequence; this one already holds tokens (use restart)")
        self.episode.messages = list(messages)
        self._write(self.renderer.prompt_ids(messages, self.tools), sampled=False, turn=-1)

    def assistant(self, completion: Completion, message: Message, turn: int) -> None:
        """Append the sampled ids with their behaviour log-probs (mask 1) and the message they decode to."""
        self._write(completion.token_ids, sampled=True, turn=turn, logprobs=completion.logprobs)
        self.episode.messages.append(message)
        self.closed = completion.closed

    def scripted(self, completion: Completion, message: Message, turn: int) -> None:
        """Append a scripted assistant turn's ids as context (mask 0: no policy sampled them) and its message."""
        self._write(completion.token_ids, sampled=False, turn=turn)
        self.episode.messages.append(message)
        self.closed = completion.closed

    def observation_ids(self, messages: list[Message], *, closed: bool | None = None) -> list[int]:
        """The ids ``observe`` would append for ``messages`` after the last assistant message (nothing appended).

        ``closed``: whether the last sampled turn ended with its end-of-turn token (if not, the
        renderer adds it, as context); None: as the last ``assistant`` completion did.
        """
        if closed is None:
            closed = self.closed
        try:
            return self.renderer.continuation_ids(self.episode.messages, messages, self.tools, closed=closed)
        except HistoryRewritten:
            return Rerendered(self.renderer.prompt_ids([*self.episode.messages, *messages], self.tools))

    def length_after(self, ids: list[int]) -> int:
        """Tokens the live sequence will hold once ``observe`` has taken ``ids`` (from ``observation_ids``)."""
        return len(ids) if isinstance(ids, Rerendered) else len(self) + len(ids)

    def observe(self, messages: list[Message], ids: list[int], turn: int) -> None:
        """Append ``messages`` as context (mask 0): ``ids`` must be ``observation_ids(messages)``.

        ``Rerendered`` ids start a new segment instead: the closed one keeps its sampled tokens
        (trained), the new one is the template's rendering of the whole conversation (mask 0, turn -1).
        """
        if isinstance(ids, Rerendered):
            conversation = [*self.episode.messages, *messages]
            self.close_segment(ended_by="template")
            self.episode.messages = conversation
            self._write(ids, sampled=False, turn=-1)
            self.episode.info["template_restarts"] = self.episode.info.get("template_restarts", 0) + 1
            return
        self._write(ids, sampled=False, turn=turn)
        self.episode.messages.extend(messages)

    def restart(self, messages: list[Message], *, ended_by: str) -> None:
        """Close the live sequence as a segment (``ended_by``) and start a new one from ``messages``."""
        self.close_segment(ended_by=ended_by)
        self.prompt(messages)

    def close_segment(self, *, ended_by: str) -> None:
        """Close the live sequence as a segment (``ended_by``); the live sequence is then empty."""
        e = self.episode
        e.segments.append(Segment(e.input_ids, e.loss_mask, e.behavior_logprobs, e.turn_index, list(e.messages),
                                  ended_by))
        self._clear()

    def open_branch(self, messages: list[Message]) -> Live:
        """Pause the live sequence and start another from ``messages``; returns the paused one."""
        e = self.episode
        paused = Live(e.input_ids, e.loss_mask, e.behavior_logprobs, e.turn_index, e.messages)
        self._clear()
        self.prompt(messages)
        return paused

    def close_branch(self, paused: Live, *, ended_by: str) -> int:
        """Close the live (branch) sequence as a segment and resume ``paused``; returns the branch's length."""
        e = self.episode
        length = len(e.input_ids)
        e.segments.append(Segment(e.input_ids, e.loss_mask, e.behavior_logprobs, e.turn_index, e.messages, ended_by))
        e.input_ids, e.loss_mask, e.behavior_logprobs = paused.input_ids, paused.loss_mask, paused.behavior_logprobs
        e.turn_index, e.messages = paused.turn_index, paused.messages
        return length

    def write_ids(self, ids: list[int], *, sampled: bool, turn: int, logprobs: list[float] | None = None) -> None:
        """Append raw ids (mask 1 with ``sampled``): for sequences built by hand, as tests do."""
        self._write(ids, sampled=sampled, turn=turn, logprobs=logprobs)

    def _clear(self) -> None:
        e = self.episode
        e.input_ids, e.loss_mask, e.behavior_logprobs, e.turn_index, e.messages = [], [], [], [], []

    def _write(self, ids: list[int], *, sampled: bool, turn: int, logprobs: list[float] | None = None) -> None:
        e = self.episode
        if sampled:
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError("sampled ids need one behaviour log-prob each")
            e.behavior_logprobs.extend(float(x) for x in logprobs)
        else:
            if logprobs is not None:
                raise ValueError("context ids (mask 0) carry no behaviour log-probs")
            e.behavior_logprobs.extend([0.0] * len(ids))
        e.input_ids.extend(ids)
        e.loss_mask.extend([1 if sampled else 0] * len(ids))
        e.turn_index.extend([turn] * len(ids))


def untrain(episode: Episode, segment: int, end: int) -> None:
    """Set the loss mask of closed segment ``segment``'s tokens before position ``end`` to 0 (and their log-probs).

    For scripted demonstrations whose opening must be context, not a target (a trial demo's failed
    first attempt): the ids stay as they were played; only what trains changes.
    """
    closed = episode.segments[segment]
    if not 0 <= end <= len(closed.input_ids):
        raise ValueError(f"untrain: position {end} is outside segment {segment} of {len(closed.input_ids)} tokens")
    episode.segments[segment] = dataclasses.replace(
        closed, loss_mask=[0] * end + list(closed.loss_mask[end:]),
        behavior_logprobs=[0.0] * end + list(closed.behavior_logprobs[end:]))


def join(episode: Episode, sequences: list[Segment]) -> None:
    """Make ``sequences`` the episode's: all but the last closed (as given), the last one live.

    For an episode assembled from others (a trial from its attempts); the sequences' arrays are
    taken as they were recorded, never rewritten.
    """
    if episode.input_ids or episode.segments:
        raise RuntimeError("join assembles a fresh episode; this one already holds tokens")
    if not sequences:
        return
    episode.segments.extend(sequences[:-1])
    last = sequences[-1]
    episode.input_ids, episode.loss_mask = last.input_ids, last.loss_mask
    episode.behavior_logprobs, episode.turn_index = last.behavior_logprobs, last.turn_index
    episode.messages = last.messages
