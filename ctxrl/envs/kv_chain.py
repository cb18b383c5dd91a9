"""The ``kv_chain`` environment: follow a chain of key -> key lookups to a final value.

Each task hides a small key-value store. The prompt names a start key; the ``lookup`` tool
returns, for a key, either the next key (``next K4821``) or the end of the chain
(``value 731``). The agent must call ``lookup`` once per hop and answer ``<answer>731</answer>``.
Distractor keys in the store point elsewhere (to other distractors or to wrong values), so
guessing from the store's shape does not work; only following the chain does.

Why it exists: the horizon is a dial. ``hops`` sets how many tool turns an episode needs, so
the history (every call and observation) grows linearly until it outgrows a context budget:
the long-horizon testbed of the context-management work (summarising or folding history).

Context: ``hops`` (train 2-4, ood 6-8) and ``distractors`` (extra keys in the store, 0-4
everywhere). An episode needs ``hops + 1`` turns, so set ``env.max_turns`` accordingly
(``hops + 1`` for the largest hops of the split you run).

Reward: 1 for the right final value in ``<answer>...</answer>``, else 0; the episode ends at
the first turn without a tool call. A lookup of an unknown key is an ``Error:`` observation.

Scripted summaries (``summary``, for warm-start demos under ``context.manager=summarize``):
``Lookups done: 3. Next key: K4821.``, or ``... The chain ended with value 731.``
"""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.types import Message, Task

PROMPTS = ("Start at key {start} and follow the chain with the lookup tool. What is the final value?",
           "Follow the key chain from {start} to its end. What value does it end with?")


def _key(rng: random.Random, used: set[str]) -> str:
    while True:
        key = f"K{rng.randrange(1000, 10000)}"
        if key not in used:
            used.add(key)
            return key


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """A chain of ``hops`` lookups plus ``distractors`` keys that lead elsewhere."""
    hops, distractors = int(context["hops"]), int(context["distractors"])
    used: set[str] = set()
    chain = [_key(rng, used) for _ in range(hops)]
    value = str(rng.randrange(100, 1000))
    store: dict[str, str] = {}
    for here, nxt in zip(chain, chain[1:]):
        store[here] = f"next {nxt}"
    store[chain[-1]] = f"value {value}"
    others = [_key(rng, used) for _ in range(distractors)]
    for i, key in enumerate(others):
        if i + 1 < len(others) and rng.random() < 0.5:
            store[key] = f"next {others[i + 1]}"
        else:
            wrong = str(rng.randrange(100, 1000))
            store[key] = f"value {wrong if wrong != value else str((int(value) + 1) % 900 + 100)}"
    prompt = rng.choice(PROMPTS).format(start=chain[0])
    return prompt, value, {"store": store, "chain": chain}


@register("kv_chain")
class KVChainEnv(ToolAnswerEnv):
    """Follow ``hops`` key lookups through the ``lookup`` tool; reward 1 for the final value."""

    name: ClassVar[str] = "kv_chain"
    system_prompt: ClassVar[str] = "Use the lookup tool to follow the chain. Reply with <answer>VALUE</answer>."
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("hops", "int", low=2, high=4, default=3, ood_low=6, ood_high=8,
                     description="lookups from the start key to the final value"),
        ContextParam("distractors", "int", low=0, high=4, default=2, ood_low=0, ood_high=4,
                     description="extra keys in the store that lead elsewhere"),
    ])

    required_data: ClassVar[tuple[str, ...]] = ("store", "chain")
    generate = staticmethod(generate)

    def make_tools(self) -> list[Tool]:
        return [Tool(name="lookup", description="Look up a key: returns the next key or the final value.",
                     parameters={"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
                     fn=self._lookup, timeout_s=5.0)]

    def _lookup(self, key: str) -> str:
        if self._task is None:
            raise EnvError("lookup before reset")
        store = self._task.data["store"]
        key = key.strip()
        if key not in store:
            raise KeyError(f"unknown key {key!r}")
        return store[key]

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return given.strip() == task.answer, {}

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """One ``lookup`` per key of the chain, then the answer."""
        chain = task.data.get("chain")
        if not isinstance(chain, list) or not chain:
            raise EnvError(f"task {task.id} has no data['chain']; kv_chain tasks need it to be solved")
        return [format_tool_call("lookup", {"key": key}) for key in chain] + [f"<answer>{task.answer}</answer>"]

    @classmethod
    def summary(cls, task: Task, messages: list[Message]) -> str:
        """What a summary holds after the lookups in ``messages``: how many are done, and where the chain stands.

        Only what the episode has shown: the lookups' observations (the start key, from the task,
        before any). The next key (or the final value) is all the solver needs to go on from a
        restarted context; the count is carried from summary to summary. How many hops are left is
        not in it: nothing the policy saw tells that.
        """
        seen = [m.content.strip() for m in messages
                if m.role == "tool" and m.name == "lookup" and not m.content.startswith("Error")]
        if not seen:
            chain = task.data.get("chain") or ["?"]
            return f"No lookups yet. Next key: {chain[0]}."
        kind, _, what = seen[-1].partition(" ")
        if kind == "value":
            return f"Lookups done: {len(seen)}. The chain ended with value {what}."
        return f"Lookups done: {len(seen)}. Next key: {what}."

    @classmethod
    def corpus(cls, n: int, seed: int) -> list[str]:
        """Plain-text transcripts of solved train tasks (not in the tiny model's default recipe)."""
        texts = [cls.system_prompt, json.dumps(cls().tools[0].schema())]
        for task in cls.sample_tasks("train", n, seed):
            steps = [f"{format_tool_call('lookup', {'key': k})}\n{task.data['store'][k]}" for k in task.data["chain"]]
            texts.append("\n".join([task.prompt, *steps, f"<answer>{task.answer}</answer>"]))
        return texts
