"""The ``search_qa`` environment: multi-hop questions over a local knowledge base, via search.

Search-R1 style, offline. A synthetic knowledge base of fictional people, companies, cities and
countries (invented names, so no model can know the answers beforehand) is written as one short
document per entity and indexed with BM25 (``ctxrl.tools.search``). A question chains ``hops``
facts, e.g. 2 hops: *"In which city is the company that Alda Morvi works for headquartered?"*
(person -> company -> city). The agent calls ``search(query)`` as often as it likes and answers
``<answer>Keltra</answer>``.

Reward: exact match after the usual normalisation (case, punctuation, articles); ``info`` also
carries the token F1. Context: ``hops`` (train 1-2, ood 3). The knowledge base is fixed (built
from ``KB_SEED``) and shared by every split; held-out questions are unseen questions about it.

Scripted summaries (``summary``, for warm-start demos under ``context.manager=summarize``): the
latest fact found on the question's path, a sentence copied from the search results, e.g.
``Found: Brada Labs is a company headquartered in Keltra.``

Imperfect warm-start scripts: ``shortcut`` answers after the first search
(``sft.shortcut_fraction``: right on 1-hop questions only); ``redundant`` searches the answer once
more before giving it (``sft.redundant_fraction``), a policy with a search to spare for OTC's
reward to cut.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.tools.search import Document, SearchIndex, exact_match, search_tool, token_f1
from ctxrl.types import Message, Task

KB_SEED = 0
PRETRAINING_KB_SEED = 1000  # worlds the tiny model pre-trains on: never the environment's own
N_PEOPLE, N_COMPANIES, N_CITIES, N_COUNTRIES = 120, 30, 24, 8
_SYLLABLES = ("al", "bra", "cor", "da", "el", "fen", "gar", "hol", "ir", "ka", "lor", "mor", "nes", "or", "pra",
              "quel", "ris", "sol", "tar", "um", "vel", "wen", "xan", "yor", "zel")


@dataclass(frozen=True)
class KnowledgeBase:
    people: dict[str, dict[str, str]]     # name -> {"born_in": city, "works_for": company}
    companies: dict[str, dict[str, str]]  # name -> {"hq": city}
    cities: dict[str, dict[str, str]]     # name -> {"country": country}
    countries: list[str]

    def documents(self) -> list[Document]:
        docs = []
        for name, p in self.people.items():
            docs.append(Document(f"person:{name}", name, f"{name} was born in {p['born_in']}. "
                                                         f"{name} works for {p['works_for']}."))
        for name, c in self.companies.items():
            docs.append(Document(f"company:{name}", name, f"{name} is a company headquartered in {c['hq']}."))
        for name, c in self.cities.items():
            docs.append(Document(f"city:{name}", name, f"{name} is a city in {c['country']}."))
        return docs


def _names(rng: random.Random, n: int, parts: int, used: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()
        if name not in used:
            used.add(name)
            out.append(name)
    return out


@functools.lru_cache(maxsize=4)
def knowledge_base(seed: int = KB_SEED) -> KnowledgeBase:
    rng = random.Random(f"ctxrl-kb:{seed}")
    used: set[str] = set()
    countries = _names(rng, N_COUNTRIES, 3, used)
    cities = {c: {"country": rng.choice(countries)} for c in _names(rng, N_CITIES, 2, used)}
    city_names = list(cities)
    companies = {f"{c} {rng.choice(('Systems', 'Works', 'Labs', 'Trading'))}": {"hq": rng.choice(city_names)}
                 for c in _names(rng, N_COMPANIES, 2, used)}
    company_names = list(companies)
    firsts, lasts = _names(rng, N_PEOPLE, 2, used), _names(rng, N_PEOPLE, 2, used)
    people = {f"{first} {last}": {"born_in": rng.choice(city_names), "works_for": rng.choice(company_names)}
              for first, last in zip(firsts, lasts)}
    return KnowledgeBase(people, companies, cities, countries)


@functools.lru_cache(maxsize=4)
def kb_index(seed: int = KB_SEED) -> SearchIndex:
    """The BM25 index of the knowledge base, built once per process."""
    return SearchIndex(knowledge_base(seed).documents())


# question templates: (hops, template, path of relations from the person)
QUESTIONS = [
    (1, "In which city was {person} born?", ("born_in",)),
    (1, "Which company does {person} work for?", ("works_for",)),
    (2, "In which country was {person} born?", ("born_in", "country")),
    (2, "In which city is the company that {person} works for headquartered?", ("works_for", "hq")),
    (3, "In which country is the company that {person} works for headquartered?", ("works_for", "hq", "country")),
]


def _follow(kb: KnowledgeBase, person: str, path: tuple[str, ...]) -> tuple[list[str], str]:
    """(the entities to look up, in order, and the answer)."""
    lookups, here = [person], kb.people[person][path[0]]
    for relation in path[1:]:
        lookups.append(here)
        here = (kb.companies if relation == "hq" else kb.cities)[here][relation]
    return lookups, here


def _fact(results: str, query: str, path: list[str]) -> str | None:
    """From a ``search`` observation: the sentence of the document titled ``query`` naming the next entity on ``path``.

    The whole document when ``query`` is not on the path; None when no result has that title.
    """
    wanted = query.strip().lower()
    for line in results.splitlines():
        title, sep, text = line.partition(": ")
        if not sep or title.partition("] ")[2].strip().lower() != wanted:
            continue
        lowered = [p.lower() for p in path]
        if wanted in lowered[:-1]:
            following = path[lowered.index(wanted) + 1]
            for sentence in re.split(r"(?<=\.)\s+", text.strip()):
                if re.search(rf"\b{re.escape(following)}\b", sentence):
                    return sentence
        return text.strip()
    return None


def generate(context: dict[str, Any], rng: random.Random, kb_seed: int = KB_SEED) -> tuple[str, str, dict[str, Any]]:
    kb = knowledge_base(kb_seed)
    hops = int(context["hops"])
    _, template, path = rng.choice([q for q in QUESTIONS if q[0] == hops])
    person = rng.choice(sorted(kb.people))
    lookups, answer = _follow(kb, person, path)
    return template.format(person=person), answer, {"lookups": lookups}


@register("search_qa")
class SearchQAEnv(ToolAnswerEnv):
    """Multi-hop questions over a local BM25-indexed knowledge base; reward = exact match."""

    name: ClassVar[str] = "search_qa"
    system_prompt: ClassVar[str] = "Use the search tool to find facts. Reply with <answer>ANSWER</answer>."
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("hops", "int", low=1, high=2, default=1, ood_low=3, ood_high=3,
                     description="facts chained by the question"),
    ])

    required_data: ClassVar[tuple[str, ...]] = ("lookups",)
    kb_seed: ClassVar[int] = KB_SEED
    """Which synthetic world the questions and the index come from (``pretraining_variant`` changes it)."""

    @classmethod
    def generate(cls, context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        return generate(context, rng, cls.kb_seed)

    def make_tools(self) -> list[Tool]:
        return [search_tool(kb_index(self.kb_seed))]

    @classmethod
    def pretraining_variant(cls, seed: int) -> type[SearchQAEnv]:
        """The same environment over another invented world (for the tiny model's pre-training).

        A base model must bring the skill (search, read, copy a name), never the facts: text from
        the training world would let a small model memorise train answers, which is success on
        ``train`` that says nothing about ``heldout``.
        """
        return type(f"{cls.__name__}World{seed}", (cls,), {"kb_seed": PRETRAINING_KB_SEED + seed})

    @classmethod
    def shortcut(cls, task: Task) -> list[str]:
        """Answer after the first search only: right for 1-hop questions, the middle entity for longer ones.

        Stopping after one lookup is the search agent's classic mistake; demos that make it are
        an imperfect warm start that RL has to fix (search again, then answer).
        """
        lookups = task.data.get("lookups")
        if not isinstance(lookups, list) or not lookups:
            raise EnvError(f"task {task.id} has no data['lookups']; search_qa tasks need it")
        first = lookups[1] if len(lookups) > 1 else task.answer  # what the first search reveals
        return [format_tool_call("search", {"query": lookups[0]}), f"<answer>{first}</answer>"]

    @classmethod
    def redundant(cls, task: Task) -> list[str]:
        """Solve, then search the answer once more before giving it: right, with one search too many.

        Checking a found answer with another search is the over-calling that OTC (Wang et al. 2025)
        trains away; demos that do it give OTC's reward something to cut (sft.redundant_fraction).
        """
        return [*cls.solve(task)[:-1], format_tool_call("search", {"query": task.answer}),
                f"<answer>{task.answer}</answer>"]

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return exact_match(given, task.answer), {"f1": token_f1(given, task.answer)}

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """Search for each entity along the chain, then answer."""
        lookups = task.data.get("lookups")
        if not isinstance(lookups, list) or not lookups:
            raise EnvError(f"task {task.id} has no data['lookups']; search_qa tasks need it to be solved")
        return [format_tool_call("search", {"query": q}) for q in lookups] + [f"<answer>{task.answer}</answer>"]

    @classmethod
    def summary(cls, task: Task, messages: list[Message]) -> str:
        """What a summary holds after the searches in ``messages``: the latest fact found on the question's path.

        Only what the episode has shown: a sentence copied from the search results in ``messages``
        (of the searched entity's document, the one naming the next entity on the path or the
        answer; the question says which relation to follow). Earlier facts are left out on
        purpose: the path is a chain, so its latest fact holds all the rest of the task needs
        (what to search next, or the answer), and two or three full sentences would outgrow
        ``context.summarize.max_tokens`` (64 by default) on the tiny model's tokenizer.
        """
        path = [*(task.data.get("lookups") or []), task.answer]
        latest = None
        queries: list[str] = []
        for m in messages:
            if m.role == "assistant":
                queries = [str(c.arguments.get("query", "")) for c in m.tool_calls if c.name == "search"]
            elif m.role == "tool" and m.name == "search" and queries:
                latest = _fact(m.content, queries.pop(0), path) or latest
        return f"Found: {latest}" if latest else "Nothing found yet."
