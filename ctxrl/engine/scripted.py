"""``ScriptedEngine``: an ``Engine`` that "samples" fixed assistant texts, for demonstrations.

Supervised warm-start data and the token-faithfulness tests go through the very same agent loop
as RL rollouts: the scripted engine returns the ids of the next scripted text followed by the
end-of-turn token, with log-prob 0, exactly as if the policy had sampled them.

Environments write their scripted solutions with Hermes tool calls (``format_tool_call``); the
engine rewrites the calls of every scripted text into the renderer's tool-call format
(``ChatRenderer.rewrite_hermes``: parsed as Hermes, rendered as the policy's family writes them,
the prose kept before them), so a demonstration for a Llama or Mistral policy shows calls the way
that policy writes them. For a Hermes policy the texts are played exactly as given.

A side request (``purpose`` other than ``turn``: the ``summarize`` manager's ``summary``, the meta
loop's ``reflection``) is answered by the script given for that purpose, and does not use up a
turn: the next turn request gets the next scripted text. The engine never reads its prompt to
tell them apart; the agent loop says which one it asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Completion, SamplingParams


class ScriptedEngine:
    """Replays ``texts`` one per turn request; raises if asked for more turns than scripted.

    ``summary`` / ``reflection`` (or any purpose in ``scripts``): called on each such side request
    for the text to "sample"; a side request without a script is an error. The texts it gave are
    kept in ``asides[purpose]`` (``summaries`` and ``reflections`` for the two built-in ones).
    """

    policy_version = 0

    def __init__(self, texts: list[str], renderer: ChatRenderer, *, summary: Callable[[], str] | None = None,
                 reflection: Callable[[], str] | None = None,
                 scripts: Mapping[str, Callable[[], str]] | None = None) -> None:
        self._renderer = renderer
        self._turns = [self._ids(text) for text in texts]
        self._scripts: dict[str, Callable[[], str]] = dict(scripts or {})
        if summary is not None:
            self._scripts["summary"] = summary
        if reflection is not None:
            self._scripts["reflection"] = reflection
        self.asides: dict[str, list[str]] = {purpose: [] for purpose in ("summary", "reflection", *self._scripts)}
        self.prompts: list[list[int]] = []
        self._turns_played = 0

    @property
    def summaries(self) -> list[str]:
        return self.asides["summary"]

    @property
    def reflections(self) -> list[str]:
        return self.asides["reflection"]

    def extend(self, texts: list[str]) -> None:
        """Script more turns after the ones given so far (a demo whose next attempt follows its reflection)."""
        self._turns += [self._ids(text) for text in texts]

    def _ids(self, text: str) -> list[int]:
        """A scripted text's ids as the policy would sample them, its calls in the policy's format."""
        return self._renderer.assistant_ids(self._renderer.rewrite_hermes(text))

    def load_weights(self, state: Mapping[str, Any], *, version: int) -> None:
        raise TypeError("a ScriptedEngine replays texts and has no weights to load")

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        if params.purpose != "turn":
            script = self._scripts.get(params.purpose)
            if script is None:
                raise RuntimeError(f"the agent loop asked for a {params.purpose}, but this scripted engine has no "
                                   f"{params.purpose} script "
                                   f"(ScriptedEngine(..., scripts={{{params.purpose!r}: ...}}))")
            self.asides.setdefault(params.purpose, []).append(script())
            ids = self._ids(self.asides[params.purpose][-1])
        else:
            if self._turns_played >= len(self._turns):
                raise RuntimeError(f"scripted engine has only {len(self._turns)} turns")
            ids = self._turns[self._turns_played]
            self._turns_played += 1
        self.prompts.append(list(prompt_ids))
        if len(ids) > params.max_new_tokens:
            return Completion(ids[: params.max_new_tokens], [0.0] * params.max_new_tokens, "length")
        return Completion(list(ids), [0.0] * len(ids), "stop")
