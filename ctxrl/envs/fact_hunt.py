"""The ``fact_hunt`` environment: read a trail of pages; the answer is the first page's fact and the last's.

Each task hides a trail of ``pages`` pages. The prompt names the first page; the ``read`` tool
returns a page's lines: first its fact (``code 731``), then ``distractors`` other numbers
(``other 482``) and ``filler`` words of text in a shuffled order, and last where the trail goes
(``next P4821``, or ``end`` on the last page). The fact leads its page because the skill measured
is carrying it, not finding it: with the fact shuffled among the other numbers, the 5.2M tiny
model followed every trail but picked the wrong number (0.05 held-out even with the whole history).
The answer is **the first page's code and the last page's code**, in that order:
``<answer>731 482</answer>``. (Joined rather than summed: the task is about carrying a fact through
a long episode, and a small model that cannot add three-digit numbers could then not show it; the
check reads the numbers of the answer, so ``731, 482`` is right too.)

Why it exists: it is the task where keeping only the newest turns fails by construction. The
first code is seen once, in the first observation, and is needed only at the end, after every
other page; a ``window`` manager whose budget holds fewer turns than the trail has dropped it and
can only guess, while a ``summarize`` (or ``fold``) manager can carry it in its summary
(SUPO / ReSum / Context-Folding test on such tasks: answers that combine facts found early and
late). ``kv_chain``, by contrast, is answered from the newest observation alone.

Context: ``pages`` (train 2-4, ood 6-8), ``distractors`` (other numbers per page, 0-3; ood 2-4)
and ``filler`` (words of filler text per page, 0-12; ood 8-16: longer observations fill a budget
sooner). An episode needs ``pages + 1`` turns, so set ``env.max_turns`` accordingly.

Reward: 1 when the numbers in ``<answer>...</answer>`` are the first and the last code, else 0; the
episode ends at the first turn without a tool call. Reading an unknown page is an ``Error:`` observation.

Scripted summaries (``summary``, for warm-start demos under ``context.manager=summarize``):
``Pages read: 2. First code: 731. Next page: P4821.``, and after the last page
``Pages read: 4. First code: 731. Last code: 482.`` Only what the episode has shown.

Scripted folding (``folded``, for warm-start demos under ``context.manager=fold``): read the first
page, then ``branch`` into following the trail from the next page, read the rest inside the branch,
``return`` its last code, and answer from the first page (still in the main context) and the
branch's result. The main context never holds the later pages. ``pages + 3`` turns (``pages + 1``
for a 1-page trail, which has nothing to branch into).
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.types import Message, Task

PROMPTS = ("Read the pages from {start} to the end with the read tool. Answer the first page's code and the last "
           "page's code.",
           "Start at page {start} and follow the trail to its last page. What are the first code and the last code?")
WORDS = ("the", "river", "old", "map", "shows", "a", "quiet", "town", "near", "hills", "where", "people", "trade",
         "wool", "and", "salt", "every", "spring")


def _page(rng: random.Random, used: set[str]) -> str:
    while True:
        name = f"P{rng.randrange(1000, 10000)}"
        if name not in used:
            used.add(name)
            return name


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """A trail of ``pages`` pages, each with a distinct code, distractor numbers and filler words."""
    n, distractors, filler = int(context["pages"]), int(context["distractors"]), int(context["filler"])
    used: set[str] = set()
    trail = [_page(rng, used) for _ in range(n)]
    codes = rng.sample(range(100, 1000), n + n * distractors)  # every number of the task distinct
    pages: dict[str, str] = {}
    for i, name in enumerate(trail):
        others = codes[n + i * distractors: n + (i + 1) * distractors]
        lines = [f"other {x}" for x in others]
        if filler:
            lines.append(" ".join(rng.choice(WORDS) for _ in range(filler)))
        rng.shuffle(lines)
        # The code leads its page: finding it is not the skill measured; carrying it is.
        lines = [f"code {codes[i]}", *lines, f"next {trail[i + 1]}" if i + 1 < n else "end"]
        pages[name] = "\n".join(lines)
    prompt = rng.choice(PROMPTS).format(start=trail[0])
    return prompt, f"{codes[0]} {codes[n - 1]}", {"pages": pages, "trail": trail, "codes": codes[:n]}


_CARRIED = (r"Pages read: (\d+)", r"First code: (\d+)", r"Next page: (P\d+)", r"Last code: (\d+)")


def _code(text: str) -> str | None:
    for line in text.splitlines():
        kind, _, value = line.partition(" ")
        if kind == "code":
            return value.strip()
    return None


@register("fact_hunt")
class FactHuntEnv(ToolAnswerEnv):
    """Read ``pages`` pages through the ``read`` tool; reward 1 for the first code and the last code."""

    name: ClassVar[str] = "fact_hunt"
    system_prompt: ClassVar[str] = ("Use the read tool to follow the pages. Reply with <answer>FIRST LAST</answer>: "
                                    "the first page's code and the last page's code.")
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("pages", "int", low=2, high=4, default=3, ood_low=6, ood_high=8,
                     description="pages in the trail (the answer needs the first and the last)"),
        ContextParam("distractors", "int", low=0, high=3, default=1, ood_low=2, ood_high=4,
                     description="other numbers on each page"),
        ContextParam("filler", "int", low=0, high=12, default=4, ood_low=8, ood_high=16,
                     description="words of filler text on each page"),
    ])

    required_data: ClassVar[tuple[str, ...]] = ("pages", "trail")
    generate = staticmethod(generate)

    def make_tools(self) -> list[Tool]:
        return [Tool(name="read", description="Read a page: its lines, and the next page (or end).",
                     parameters={"type": "object", "properties": {"page": {"type": "string"}}, "required": ["page"]},
                     fn=self._read, timeout_s=5.0)]

    def _read(self, page: str) -> str:
        if self._task is None:
            raise EnvError("read before reset")
        pages = self._task.data["pages"]
        page = page.strip()
        if page not in pages:
            raise KeyError(f"unknown page {page!r}")
        return pages[page]

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return re.findall(r"\d+", given) == task.answer.split(), {}

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """One ``read`` per page of the trail, then the two codes."""
        trail = task.data.get("trail")
        if not isinstance(trail, list) or not trail:
            raise EnvError(f"task {task.id} has no data['trail']; fact_hunt tasks need it to be solved")
        return [format_tool_call("read", {"page": p}) for p in trail] + [f"<answer>{task.answer}</answer>"]

    @classmethod
    def folded(cls, task: Task) -> list[str]:
        """``solve`` played under ``fold``: read the first page, branch into the rest, return the last code.

        The branch's goal names the page it starts from (the branch's context is only the task and
        the goal, so it must), and its result is the last code alone: the first code stays in the
        main context, which the answer reads.
        """
        *reads, answer = cls.solve(task)
        trail = task.data["trail"]
        if len(trail) < 2:
            return [*reads, answer]  # one page: nothing follows it, nothing to fold away
        goal = f"Follow the trail from {trail[1]} to its last page; return the last code."
        return [reads[0], format_tool_call("branch", {"goal": goal}), *reads[1:],
                format_tool_call("return", {"result": task.answer.split()[-1]}), answer]

    @classmethod
    def summary(cls, task: Task, messages: list[Message]) -> str:
        """What a summary holds after the reads in ``messages``: how many, the first code, where the trail stands.

        The first code is what a restarted context needs and cannot see again; the last code, once the
        trail has ended, is the other half of the answer. Earlier summaries in ``messages`` (a restarted
        context's first user turn) carry the count and the first code forward.
        """
        reads = [m.content for m in messages
                 if m.role == "tool" and m.name == "read" and not m.content.startswith("Error")]
        done, first, carried, ended = 0, None, "?", None
        for m in messages:  # a summary from before: "Pages read: 2. First code: 731. Next page: P4821."
            if m.role == "user" and "Pages read:" in m.content:
                count, code, nxt, last_code = (re.search(pattern, m.content) for pattern in _CARRIED)
                done = int(count.group(1)) if count else done
                first = code.group(1) if code else first
                carried = nxt.group(1) if nxt else carried
                ended = last_code.group(1) if last_code else ended
        if not reads and ended is not None:  # the trail had ended before: nothing new to add
            return f"Pages read: {done}. First code: {first}. Last code: {ended}."
        if not reads and first is None:
            trail = task.data.get("trail") or ["?"]
            return f"No pages read yet. Next page: {trail[0]}."
        if first is None:
            first = _code(reads[0]) or "?"
        done += len(reads)
        last = reads[-1] if reads else ""
        if last.rstrip().endswith("end"):
            return f"Pages read: {done}. First code: {first}. Last code: {_code(last) or '?'}."
        nxt = last.rstrip().rpartition("next ")[2] if "next " in last else carried
        return f"Pages read: {done}. First code: {first}. Next page: {nxt}."
