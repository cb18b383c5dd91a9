"""``ScriptedEngine``: an ``Engine`` that "samples" fixed assistant texts, for demonstrations.

Supervised warm-start data and the token-faithfulness tests go through the very same agent loop
as RL rollouts: the scripted engine returns the ids of the next scripted text followed by the
end-of-turn token, with log-prob 0, exactly as if the policy had sampled them.
"""

from __future__ import annotations

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Completion, SamplingParams


class ScriptedEngine:
    """Replays ``texts`` one per ``generate`` call; raises if asked for more turns than scripted."""

    version = 0

    def __init__(self, texts: list[str], renderer: ChatRenderer) -> None:
        self._turns = [renderer.assistant_ids(text) for text in texts]
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        if len(self.prompts) >= len(self._turns):
            raise RuntimeError(f"scripted engine has only {len(self._turns)} turns")
        self.prompts.append(list(prompt_ids))
        ids = self._turns[len(self.prompts) - 1]
        if len(ids) > params.max_new_tokens:
            return Completion(ids[: params.max_new_tokens], [0.0] * params.max_new_tokens, "length")
        return Completion(list(ids), [0.0] * len(ids), "stop")
