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
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.contexts.space import ContextParam, ContextSpace, sample_tasks
from ctxrl.envs.base import EnvError
from ctxrl.envs.calculator import parse_answer
from ctxrl.envs.registry import register
from ctxrl.tools.base import Tool, execute_tool_calls
from ctxrl.tools.search import Document, SearchIndex, exact_match, search_tool, token_f1
from ctxrl.types import Message, StepResult, Task

KB_SEED = 0
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
    people = {f"{f} {l}": {"born_in": rng.choice(city_names), "works_for": rng.choice(company_names)}
              for f, l in zip(firsts, lasts)}
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


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    kb = knowledge_base()
    hops = int(context["hops"])
    _, template, path = rng.choice([q for q in QUESTIONS if q[0] == hops])
    person = rng.choice(sorted(kb.people))
    lookups, answer = _follow(kb, person, path)
    return template.format(person=person), answer, {"lookups": lookups}


@register("search_qa")
class SearchQAEnv:
    """Multi-hop questions over a local BM25-indexed knowledge base; reward = exact match."""

    name: ClassVar[str] = "search_qa"
    system_prompt: ClassVar[str] = "Use the search tool to find facts. Reply with <answer>ANSWER</answer>."
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("hops", "int", low=1, high=2, default=1, ood_low=3, ood_high=3,
                     description="facts chained by the question"),
    ])

    def __init__(self) -> None:
        self.tools: list[Tool] = [search_tool(kb_index())]
        self._task: Task | None = None
        self._terminated = False

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        return sample_tasks(generate, cls.context_space, split, n, seed,
                            heldout_fraction=cls.heldout_fraction, id_prefix=cls.name)

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """Search for each entity along the chain, then answer."""
        lookups = task.data.get("lookups")
        if not isinstance(lookups, list) or not lookups:
            raise EnvError(f"task {task.id} has no data['lookups']; search_qa tasks need it to be solved")
        return [format_tool_call("search", {"query": q}) for q in lookups] + [f"<answer>{task.answer}</answer>"]

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        self._task, self._terminated = task, False
        return [Message(role="system", content=self.system_prompt), Message(role="user", content=task.prompt)]

    async def step(self, message: Message) -> StepResult:
        """Searches -> results (reward 0); a turn without a call ends the episode with EM."""
        if self._task is None:
            raise EnvError("step() called before reset(task); start an episode with reset first")
        if self._terminated:
            raise EnvError("step() called after the episode terminated; call reset(task) to start a new episode")
        if message.tool_calls or message.tool_call_errors:
            observations, counts = await execute_tool_calls(self.tools, message)
            return StepResult(messages=observations, reward=0.0, terminated=False, info=counts)
        self._terminated = True
        given = parse_answer(message.content)
        em = given is not None and exact_match(given, self._task.answer)
        return StepResult(messages=[], reward=1.0 if em else 0.0, terminated=True,
                          info={"answered": given is not None, "correct": em,
                                "f1": token_f1(given or "", self._task.answer)})

    def close(self) -> None:
        self._task = None
        self._terminated = False
