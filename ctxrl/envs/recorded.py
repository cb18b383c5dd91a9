"""``RecordedEnv``: an environment wrapper that remembers the conversation it takes part in.

Scripted demonstrations read it (an environment's ``summary`` and ``reflection`` hooks are
written from the conversation so far), and the meta loop reads its last step: the agent loop does
not append the observations of the step that ends an episode, but the feedback on an attempt
shows them. Everything else passes through unchanged.
"""

from __future__ import annotations

from typing import Any

from ctxrl.types import Episode, Message, StepResult, Task


class RecordedEnv:
    """Wraps ``env``; ``messages`` is the opening, then each assistant message and its observations.

    Across every segment of an episode: summary requests and summaries, which the environment
    never sees, are not in it. ``last_step`` is the latest (assistant message, observations).
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.messages: list[Message] = []
        self.last_step: tuple[Message | None, list[Message]] = (None, [])

    @property
    def tools(self):
        return self.env.tools

    @property
    def names_actions(self) -> bool:
        from ctxrl.envs.hooks import flag

        return flag(self.env, "names_actions")

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        opening = self.env.reset(task, seed=seed)
        self.messages = list(opening)
        self.last_step = (None, [])
        return opening

    async def step(self, message: Message) -> StepResult:
        result = await self.env.step(message)
        self.messages += [message, *result.messages]
        self.last_step = (message, list(result.messages))
        return result

    def close(self) -> None:
        self.env.close()

    def unseen(self, episode: Episode) -> list[Message]:
        """Observations of the step that answered the episode's last message, if they were never appended."""
        message, observations = self.last_step
        return observations if episode.messages and episode.messages[-1] is message else []
