"""Sessions: the calls of one client conversation recorded as one token-faithful episode.

A session's episode is written by a ``Recorder``, exactly as the agent loop writes one:

- the first call renders its messages whole (``Recorder.prompt``: mask 0);
- a later call whose messages are the session's history (the client's view of it: what it sent,
  and what ctxrl answered) followed by new ones (tool results, a user message) appends only the
  new messages, rendered by the chat template after the sampled ids (``observation_ids`` /
  ``observe``), so the prompt the engine sees extends the last call's tokens and every sampled id
  stays in the one sequence the model produced it in;
- a call whose history differs (the client edited, truncated or reordered it, or changed its
  tools) closes the live sequence as a segment (``ended_by="edited"``) and starts a new one from
  its messages, as a summary does; ``episode.info["edited"]`` counts them;
- each reply is appended with its sampled ids and behaviour log-probs (mask 1).

Nothing is decoded and re-encoded: the ids trained on are the ids sampled.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from ctxrl.rollout.recorder import Recorder
from ctxrl.serve.protocol import APIError
from ctxrl.types import Episode, Message, Task, Turn


@dataclass
class Session:
    id: str
    episode: Episode
    recorder: Recorder
    views: list[tuple] = field(default_factory=list)
    """The history as the client sees it, one entry per message of the live sequence."""
    tools: list[dict] | None = None
    turns: int = 0
    seed: int | None = None
    """Set by a trainer: each call samples with ``derive_seed(seed, call index)``."""
    sampling: tuple[float, float, int] | None = None
    """Set by a trainer: (temperature, top_p, top_k) replacing the client's own (the behaviour policy)."""
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    finished: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def edited(self) -> int:
        return self.episode.info.get("edited", 0)

    def plan(self, messages: list[Message], views: list[tuple], tools: list[dict] | None) -> tuple[str, list[int]]:
        """How this call's prompt continues the episode: ``("new" | "extend" | "edited", ids)``, nothing written."""
        r = self.recorder
        if not len(r):
            r.tools = tools
            return "new", r.renderer.prompt_ids(messages, tools)
        n = len(self.views)
        if (tools == self.tools and len(views) > n and views[:n] == self.views
                and r.messages and r.messages[-1].role == "assistant"):
            return "extend", r.observation_ids(messages[n:])
        return "edited", r.renderer.prompt_ids(messages, tools)

    def length_after(self, kind: str, ids: list[int]) -> int:
        return self.recorder.length_after(ids) if kind == "extend" else len(ids)

    def commit(self, kind: str, ids: list[int], messages: list[Message], views: list[tuple],
               tools: list[dict] | None) -> None:
        """Write the planned prompt into the episode."""
        r = self.recorder
        if kind == "extend":
            r.observe(messages[len(self.views):], ids, self.turns - 1)
        else:
            if kind == "edited":
                r.close_segment(ended_by="edited")
                self.episode.info["edited"] = self.edited + 1
            r.tools = tools
            r.episode.messages = list(messages)
            r.write_ids(ids, sampled=False, turn=-1)
        self.views = list(views)
        self.tools = tools

    def reply(self, completion, message: Message, text: str, client_view: tuple, prompt_tokens: int) -> None:
        """Append a sampled reply (mask 1) and what the client will send back for it."""
        self.recorder.assistant(completion, message, self.turns)
        self.episode.turns.append(Turn(index=self.turns, prompt_tokens=prompt_tokens,
                                       sampled_tokens=len(completion.token_ids),
                                       finish_reason=completion.finish_reason, text=text,
                                       tool_calls=len(message.tool_calls)))
        self.views.append(client_view)
        self.turns += 1


class SessionStore:
    """Sessions by id, with an idle timeout and a cap on how many are open."""

    def __init__(self, renderer, *, max_sessions: int = 4096, timeout_s: float = 600.0) -> None:
        self.renderer = renderer
        self.max_sessions = max_sessions
        self.timeout_s = timeout_s
        self.sessions: dict[str, Session] = {}
        self.expired = 0
        self._lock = threading.RLock()  # a trainer's thread opens sessions the server's thread serves

    def get(self, session_id: str, *, create: bool = True, task: Task | None = None) -> Session:
        with self._lock:
            return self._get(session_id, create, task)

    def _get(self, session_id: str, create: bool, task: Task | None) -> Session:
        self.sweep()
        session = self.sessions.get(session_id)
        if session is None:
            if not create:
                raise APIError(404, f"no session {session_id!r} (unknown, or closed after {self.timeout_s:g} s idle)",
                               type="not_found_error", param="session", code="session_not_found")
            if len(self.sessions) >= self.max_sessions:
                raise APIError(429, f"{self.max_sessions} sessions are open; finish some or raise the limit",
                               type="rate_limit_error", code="too_many_sessions")
            episode = Episode(task=task or Task(id=session_id, prompt="", answer=""))
            session = Session(session_id, episode, Recorder(episode, self.renderer))
            self.sessions[session_id] = session
        session.last_used = time.monotonic()
        return session

    def sweep(self) -> None:
        """Close sessions idle past the timeout (counted in ``expired``; anyone waiting on one is told)."""
        now = time.monotonic()
        with self._lock:
            idle = [s for s, v in self.sessions.items() if now - v.last_used > self.timeout_s and not v.lock.locked()]
            for sid in idle:
                session = self.sessions.pop(sid)
                session.episode.info["expired"] = True
                self.expired += 1

    def pop(self, session_id: str) -> Session | None:
        with self._lock:
            return self.sessions.pop(session_id, None)
