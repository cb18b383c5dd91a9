"""The ``search_join`` environment: search two early facts, follow a trail, answer all three.

Each task has its own small knowledge base of one-fact documents about invented, short names
(two syllables: ``Dara``, ``Kelo``), indexed with BM25 and searched with ``ctxrl.tools.search``'s
``search`` tool. A document is a name (its title) and one fact. The prompt names one person, A.
Searching A shows where A works and who A's partner B is (``[1] Dara: works at Voss.``,
``[2] Dara: partner is Kelo.``); searching B shows where B works and where B's trail starts
(``Kelo: works at Brin.``, ``Kelo: trail starts at Tam.``); then ``hops`` more searches follow the
trail (``Tam: leads to Lira.``, ...) to its last name, which holds a code (``Oren: holds the code
Zeph.``). The answer is **A's firm, B's firm and the code**: ``<answer>Voss Brin Zeph</answer>``,
in any order (the check compares the words). Copying names only, no arithmetic: a small model
cannot add.

Every search result also shows the other documents that name the searched name: ``distractors``
of them per name (``[3] Pell: met Dara at Quon.``, with a firm that is not the answer) and the
trail's previous document (searching ``Tam`` shows ``Kelo: trail starts at Tam.`` too).

Why it exists: ``fact_hunt`` over search. A's firm is seen once, in the first observation, and
B's once, in the second; both are needed only at the end, after ``hops`` more searches (a test
checks that neither the prompt nor any other observation of the gold episode names them). A
``window`` manager whose budget holds fewer turns than the episode has dropped them and can only
guess (or spend turns searching A and B again), while a ``summarize`` (or ``fold``) manager can
carry them in its summary. Unlike ``search_qa`` there is no shared world: each task draws its own
names, so no answer can be memorised.

Context: ``hops`` (trail searches after A and B: train 1-3, ood 5-7) and ``distractors``
(documents per searched name that mention it and are not the answer: 1-2, ood 3-4; more of them
make every observation longer). An episode needs ``hops + 3`` turns (A, B, the trail, the
answer), so set ``env.max_turns`` accordingly (10 covers ood). A gold episode, system prompt and
tool list included, is 430-640 tokens on train tasks and 860-1,190 on ood ones with the tokenizer
of ``tiny:envs=calculator+search_join`` (the model to run it with; 204 of them are the opening),
and 610-980 / 1,350-1,900 with the default tiny tokenizer, which spells the names letter by
letter. At a budget of 448 tokens, ``window`` has dropped both firms before the answer on every
train task, and scripted ``summarize`` demos need 1-2 summaries.

The scripted solution writes every name after a space, in its queries and its answer
(``{"query": " Kelo"}``, ``<answer> Voss Brin Zeph</answer>``), so that it copies the tokens the
observation showed: a BPE tokenizer spells a name differently after a quote or a ``>``.

Reward: 1 when the words of ``<answer>...</answer>`` are the two firms and the code (any order,
case, ``and`` and punctuation ignored), else 0; the episode ends at the first turn without a tool
call. A search that matches nothing returns ``No results.``

Scripted selections (``select``, for ``context.manager=select``): keep the turns whose search
showed A's or B's firm.

Scripted summaries (``summary``, for warm-start demos under ``context.manager=summarize``): the
firms found so far and where the search stands, e.g. ``Found: Dara works at Voss. Kelo works at
Brin. Next: Tam.``, and after the trail's end ``Found: Dara works at Voss. Kelo works at Brin.
Code: Zeph.`` Only what the episode has shown; an earlier summary is carried through a restart.
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
from ctxrl.tools.search import Document, SearchIndex, search_tool
from ctxrl.types import Message, Task

# Two-syllable names (consonant-vowel twice): short for a small tokenizer and easy to copy.
NAMES = tuple(f"{a}{b}{c}{d}".capitalize() for a in "bdfgklmnprstvz" for b in "aeiou"
              for c in "bdfgklmnprstvz" for d in "aeiou")
PROMPTS = ("Search for {a}. Answer the firms of {a} and {a}'s partner, and the code that ends the partner's trail.",
           "Which firms do {a} and {a}'s partner work at, and which code ends the partner's trail?")


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """A world of one-sentence documents: A and B's firms, B's trail of ``hops`` names, distractors."""
    hops, distractors = int(context["hops"]), int(context["distractors"])
    searched = 2 + hops
    names = rng.sample(NAMES, 5 + hops + 2 * distractors * searched)
    a, b, firm_a, firm_b, code = names[:5]
    trail = names[5:5 + hops]
    fresh = iter(names[5 + hops:])
    # a document is (title, text): the name it is about, and one fact about it
    docs = [[a, f"works at {firm_a}."], [a, f"partner is {b}."],
            [b, f"works at {firm_b}."], [b, f"trail starts at {trail[0]}."]]
    docs += [[here, f"leads to {there}."] for here, there in zip(trail, trail[1:])]
    docs.append([trail[-1], f"holds the code {code}."])
    for name in [a, b, *trail]:  # others that mention each searched name (with a firm that is not the answer)
        for _ in range(distractors):
            other, place = next(fresh), next(fresh)
            docs.append([other, f"met {name} at {place}."])
    rng.shuffle(docs)
    prompt = rng.choice(PROMPTS).format(a=a)
    return prompt, f"{firm_a} {firm_b} {code}", {"docs": docs, "searches": [a, b, *trail],
                                                 "facts": [firm_a, firm_b, code]}


def _words(text: str) -> list[str]:
    return sorted(w for w in re.findall(r"[a-z]+", text.lower()) if w != "and")


_RESULT = re.compile(r"^\[\d+\] (\w+): (.*)$")  # a search result's line: "[1] Dara: works at Voss."
_WORKS = re.compile(r"\b(\w+) works at (\w+)\.")  # a summary's "Dara works at Voss."
_POINTS = re.compile(r"^(?:partner is|trail starts at|leads to) (\w+)\.$")
_CODE = re.compile(r"^holds the code (\w+)\.$")


@register("search_join")
class SearchJoinEnv(ToolAnswerEnv):
    """Search A and A's partner B, follow B's trail; reward 1 for both firms and the trail's code."""

    name: ClassVar[str] = "search_join"
    system_prompt: ClassVar[str] = ("Use the search tool to find facts. Reply with <answer>FIRM FIRM CODE</answer>: "
                                    "the two firms and the code.")
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("hops", "int", low=1, high=3, default=2, ood_low=5, ood_high=7,
                     description="trail searches after A and B (the answer also needs the first two)"),
        ContextParam("distractors", "int", low=1, high=2, default=1, ood_low=3, ood_high=4,
                     description="documents per searched name that mention it and are not the answer"),
    ])

    required_data: ClassVar[tuple[str, ...]] = ("docs", "searches")
    generate = staticmethod(generate)

    def make_tools(self) -> list[Tool]:
        self._search: Any = None  # the search tool's function over the current task's documents (reset)
        return [Tool(name="search", description="Search the documents; returns those that best match the query.",
                     parameters={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
                     fn=self._run_search, timeout_s=10.0)]

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        opening = super().reset(task, seed=seed)
        docs = [Document(f"{i}", title, text) for i, (title, text) in enumerate(task.data["docs"])]
        k = 3 + int(task.context.get("distractors", 1))  # room for every document that names the query
        self._search = search_tool(SearchIndex(docs), k=k).fn  # this task's own world
        return opening

    def _run_search(self, query: str) -> str:
        if self._task is None or self._search is None:
            raise EnvError("search before reset")
        return self._search(query)

    def close(self) -> None:
        super().close()
        self._search = None

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return _words(given) == _words(task.answer), {}

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """Search A, B and each name of the trail, then answer the two firms and the code.

        Every name is written after a space (``{"query": " Kelo"}``, ``<answer> Voss Brin Zeph</answer>``),
        as the observations print it (``partner is Kelo.``): a BPE tokenizer spells a word differently
        after a space, a quote or a ``>`` (``' Ro' 'gu'`` against ``'>R' 'o' 'gu'``), so copying the
        name the observation showed is then copying its tokens. The search and the check ignore the space.
        """
        searches = task.data.get("searches")
        if not isinstance(searches, list) or not searches:
            raise EnvError(f"task {task.id} has no data['searches']; search_join tasks need it to be solved")
        return [format_tool_call("search", {"query": f" {q}"}) for q in searches] + [f"<answer> {task.answer}</answer>"]

    @classmethod
    def select(cls, task: Task, messages: list[Message]) -> str:
        """The earlier turns to keep under ``context.manager=select``: those whose search showed A's or B's firm.

        Turns are numbered as the ``select`` manager numbers them (1 = the first assistant message of
        ``messages``); the newest turn is always kept by the manager, so it is never named. (The
        manager's own derivation from ``summary`` looks for numbers and ids, and these facts are names.)
        """
        firms = [f"works at {f}." for f in (task.data.get("facts") or [])[:2]]
        turn, keep = 0, []
        for m in messages:
            if m.role == "assistant":
                turn += 1
            elif m.role == "tool" and turn and any(firm in m.content for firm in firms) and turn not in keep:
                keep.append(turn)
        return f"<keep>{' '.join(str(n) for n in keep if n < turn)}</keep>"

    @classmethod
    def summary(cls, task: Task, messages: list[Message]) -> str:
        """What a summary holds after the searches in ``messages``: the firms found, and the next name or the code.

        The firms are what a restarted context needs and cannot see again; ``Next:`` is the name to
        search next (the pointer of the furthest document of the path shown so far), ``Code:`` the
        trail's end once found. Earlier summaries in ``messages`` (a restarted context's first user
        turn) are carried forward. Only documents the observations showed are read.
        """
        path = [str(x) for x in task.data.get("searches") or []]
        order = {name: i for i, name in enumerate(path)}
        firms: dict[str, str] = {}
        following, code = path[0] if path else "?", None  # the prompt names the first search

        def point(target: str) -> None:  # keep the furthest name along the path
            nonlocal following
            if order.get(target, -1) > order.get(following, -1):
                following = target

        for m in messages:
            if m.role == "user" and "Found:" in m.content:  # a summary from before
                carried = m.content[m.content.index("Found:"):]
                firms.update(_WORKS.findall(carried))
                nxt, end = re.search(r"Next: (\w+)", carried), re.search(r"Code: (\w+)", carried)
                if end:
                    code = end.group(1)
                elif nxt:
                    point(nxt.group(1))
            elif m.role == "tool" and m.name == "search":
                for line in m.content.splitlines():
                    found = _RESULT.match(line)
                    if not found or found.group(1) not in order:
                        continue
                    subject, text = found.groups()
                    if works := re.fullmatch(r"works at (\w+)\.", text):
                        firms[subject] = works.group(1)
                    elif points := _POINTS.match(text):
                        point(points.group(1))
                    elif end := _CODE.match(text):
                        code = end.group(1)
        known = [f"{p} works at {firms[p]}." for p in path[:2] if p in firms]
        if not known and code is None:
            return f"Nothing found yet. Next: {following}."
        return " ".join(["Found:", *known, f"Code: {code}." if code else f"Next: {following}."])
