"""``ScriptedEngine``: an ``Engine`` that "samples" fixed assistant texts, for demonstrations.

Supervised warm-start data and the token-faithfulness tests go through the very same agent loop
as RL rollouts: the scripted engine returns the ids of the next scripted text followed by the
end-of-turn token, with log-prob 0, exactly as if the policy had sampled them.

A request with ``purpose="summary"`` (the ``summarize`` context manager asking for a summary) is
answered by ``summary()``, the scripted summary of the episode so far, and does not use up a turn:
the next turn request gets the next scripted text. A request with ``purpose="reflection"`` (the
meta loop asking for a reflection on a finished attempt) is answered by ``reflection()`` in the
same way. The engine never reads its prompt to tell them apart; the agent loop says which one it
asks for.
"""

from __future__ import annotations

from typing import Callable

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Completion, SamplingParams


class ScriptedEngine:
    """Replays ``texts`` one per turn request; raises if asked for more turns than scripted.

    ``summary``: called on each summary request for the text to "sample" (None: a summary
    request is an error, since nothing scripted can answer it). ``reflection``: the same for
    reflection requests.
    """

    version = 0

    def __init__(self, texts: list[str], renderer: ChatRenderer, *, summary: Callable[[], str] | None = None,
                 reflection: Callable[[], str] | None = None) -> None:
        self._renderer = renderer
        self._turns = [renderer.assistant_ids(text) for text in texts]
        self._summary = summary
        self._reflection = reflection
        self.prompts: list[list[int]] = []
        self.summaries: list[str] = []
        self.reflections: list[str] = []
        self._turns_played = 0

    def extend(self, texts: list[str]) -> None:
        """Script more turns after the ones given so far (a demo whose next attempt follows its reflection)."""
        self._turns += [self._renderer.assistant_ids(text) for text in texts]

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        if params.purpose in ("summary", "reflection"):
            script = self._summary if params.purpose == "summary" else self._reflection
            if script is None:
                raise RuntimeError(f"the agent loop asked for a {params.purpose}, but this scripted engine has no "
                                   f"{params.purpose} script (ScriptedEngine(..., {params.purpose}=...))")
            texts = self.summaries if params.purpose == "summary" else self.reflections
            texts.append(script())
            ids = self._renderer.assistant_ids(texts[-1])
        else:
            if self._turns_played >= len(self._turns):
                raise RuntimeError(f"scripted engine has only {len(self._turns)} turns")
            ids = self._turns[self._turns_played]
            self._turns_played += 1
        self.prompts.append(list(prompt_ids))
        if len(ids) > params.max_new_tokens:
            return Completion(ids[: params.max_new_tokens], [0.0] * params.max_new_tokens, "length")
        return Completion(list(ids), [0.0] * len(ids), "stop")
