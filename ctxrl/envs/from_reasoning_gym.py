"""``reasoning_gym:TASK``: reasoning-gym's procedural task families as contextual environments.

reasoning-gym (``pip install -e '.[reasoning-gym]'``) generates about a hundred families of verifiable problems
(arithmetic chains, ciphers, logic puzzles, graph and grid tasks), each with a configuration dataclass and, for
most, a curriculum: named difficulty *attributes*, each with a list of levels (``chain_sum``'s ``num_terms`` has
levels 2, 3, ..., 12 and sets the configuration fields ``min_terms`` / ``max_terms``). ``env.name =
"reasoning_gym:chain_sum"`` makes one family an environment; ``"reasoning_gym:chain_sum,leg_counting"`` mixes
several, each task drawn from one of them (``weights``).

**Context.** A task's context is its ``family`` and one value per numeric curriculum attribute of that family
(``{"family": "chain_sum", "num_terms": 3, "num_digits": 2}``). The value sets the configuration: a range
attribute's lower and upper field both (exactly 3 terms), a scalar attribute's field. Attributes whose levels
are not numbers (operator weights, flags) keep their default level. ``train`` and ``heldout`` draw every value
between the attribute's levels ``train_levels`` (levels 0 and 1 by default: values 2..3 for ``num_terms``), and
never share a prompt (``ctxrl.tasks.split_of``); ``ood`` draws between levels ``ood_levels`` (2 and 3), leaving out
values inside the train range: harder or larger settings. ``ranges`` replaces the levels with explicit ranges and
can make any numeric configuration field a context variable; ``fixed`` sets configuration fields for every task.
A level the family's own configuration check refuses (``caesar_cipher``'s rotation level 50, past its limit of
25) is left out of its range, with a warning. A family without a curriculum has no context but ``family`` (and
no ``ood`` split) until ``ranges`` gives it some.

**Verifier.** The family's own ``score_answer`` scores the ``<answer>...</answer>`` of the first turn without a
tool call, on the exact entry the task was drawn from (found again from ``Task.data``: family, configuration,
index). Its score is the reward, in [0, 1] with the partial credit some families give; an episode succeeds when it
scores 1. ``tool`` offers the ``calculator`` or the ``python`` sandbox; the gold solution (``solve``) calls the
calculator on the task's expression where the family records one that the calculator can evaluate to the answer,
and otherwise answers directly.

Settings (``[env.reasoning_gym]``, shared by every ``reasoning_gym:`` name; ``Settings`` below documents each).

What it does not do: families without a single oracle answer (``boxnet``, ``graph_color``,
``propositional_logic``, ``rubiks_cube``, ``rush_hour``: their scorer checks a proposed solution) train and
evaluate, but have no scripted solution, so ``check-env``'s gold run and warm-start demonstrations fail for them;
``composite`` is refused (name a mix instead). Each configuration's dataset is built once (a second for the
families that read word lists or ARC grids; ``acre`` generates all its entries up front, 10 s), and each entry
costs milliseconds (up to a second or two for the puzzle generators: ``futoshiki``, ``intermediate_integration``).
"""

from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.reasoning_gym_context import FamiliesSpace, Family, family_spec
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextSpace, sample_tasks
from ctxrl.tools.base import Tool
from ctxrl.types import Task

SUMMARY = ("reasoning-gym's task families (reasoning_gym:chain_sum, or a mix: reasoning_gym:chain_sum,leg_counting), "
           "their difficulty attributes as context; the reasoning-gym extra; docs/reasoning-gym.md")
EXTRA = "pip install -e '.[reasoning-gym]'"
TOOLS = ("", "calculator", "python")
DATASET_SEED = 0
DATASET_SIZE = 10_000
"""Entries of one configuration a task can be (reasoning-gym's datasets hold 500 by default). Building a dataset can
cost a second (word lists, ARC grids) and its entries milliseconds, so each configuration's is built once."""


@dataclass(frozen=True)
class Settings:
    """The table ``[env.reasoning_gym]`` (``env.reasoning_gym.KEY=VALUE`` on the command line)."""

    train_levels: list[int] = field(default_factory=lambda: [0, 1])
    """First and last curriculum level (inclusive) of the train and heldout values of every attribute."""
    ood_levels: list[int] = field(default_factory=lambda: [2, 3])
    """First and last curriculum level of the ood values (past an attribute's last level: its last); values inside
    the train range are left out."""
    ranges: list[str] = field(default_factory=list)
    """Explicit ranges, ``[FAMILY.]NAME=LOW..HIGH`` (no ood range) or ``[FAMILY.]NAME=LOW..HIGH/OOD_LOW..OOD_HIGH``:
    NAME is a curriculum attribute (replacing its levels) or a numeric configuration field (made a context
    variable)."""
    fixed: list[str] = field(default_factory=list)
    """Configuration fields set for every task, ``[FAMILY.]FIELD=VALUE`` with a TOML value (``allow_negation=true``,
    ``operators=["+", "-"]``)."""
    weights: list[float] = field(default_factory=list)
    """For a mix: the chance of each family, in the order of the name (default: equal)."""
    tool: str = ""
    """A tool to offer: ``calculator``, ``python`` (the sandbox) or none (``""``)."""
    system_prompt: str = "direct"
    """One of reasoning-gym's system prompts by name (``direct``, ``default``, ``simple``, ``chain_of_draft``,
    ``DeepSeekZero``), or a text of your own; it must ask for ``<answer>...</answer>``."""
    heldout_fraction: float = 0.2
    """The share of prompts that belong to ``heldout`` instead of ``train``."""

    def __post_init__(self) -> None:
        for key in ("train_levels", "ood_levels"):
            levels = getattr(self, key)
            if len(levels) != 2 or not 0 <= levels[0] <= levels[1]:
                raise ValueError(f"{key} must be [FIRST, LAST], two curriculum levels with 0 <= FIRST <= LAST, "
                                 f"got {levels}")
        if self.tool not in TOOLS:
            raise ValueError(f"tool must be calculator, python or \"\" (none), got {self.tool!r}")
        if any(not math.isfinite(w) or w < 0 for w in self.weights) or (self.weights and not sum(self.weights)):
            raise ValueError(f"weights must be numbers >= 0 with a positive sum, got {self.weights}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise EnvError(f"reasoning_gym environments need the reasoning-gym package: {EXTRA}") from None
    return reasoning_gym


def environment(rest: str) -> type:
    """The class ``reasoning_gym:REST`` names (one family, or a comma-separated mix)."""
    families = tuple(name.strip() for name in rest.split(","))
    if not rest or not all(families):
        raise EnvError(f"reasoning_gym:{rest} names no task family; write reasoning_gym:NAME (e.g. "
                       "reasoning_gym:chain_sum) or a mix, reasoning_gym:chain_sum,leg_counting")
    return _family_class(families)


@functools.cache
def _family_class(families: tuple[str, ...]) -> type:
    _reasoning_gym()
    from reasoning_gym.factory import DATASETS

    for name in families:
        if name == "composite":
            raise EnvError("reasoning_gym:composite is reasoning-gym's own mix; name a mix of families instead: "
                           "reasoning_gym:chain_sum,leg_counting (weights in [env.reasoning_gym] weights)")
        if name not in DATASETS:
            import difflib

            close = difflib.get_close_matches(name, DATASETS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise EnvError(f"reasoning-gym has no task family {name!r}; {hint}its families: "
                           f"{', '.join(sorted(n for n in DATASETS if n != 'composite'))}")
    if len(set(families)) != len(families):
        raise EnvError(f"reasoning_gym:{','.join(families)} names a family twice; give weights instead")
    name = "reasoning_gym:" + ",".join(families)
    return type(f"ReasoningGym[{','.join(families)}]", (ReasoningGymEnv,), {"families": families, "name": name})


# -- entries: one per task, regenerated to score ----------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _dataset(family: str, config_json: str) -> Any:
    """The family's dataset of a configuration (built once: see ``DATASET_SIZE``)."""
    rg = _reasoning_gym()
    config = json.loads(config_json)
    try:
        return rg.create_dataset(family, **config, seed=DATASET_SEED, size=DATASET_SIZE)
    except (AssertionError, ValueError, TypeError) as exc:
        raise EnvError(f"reasoning_gym:{family} refused the configuration {config} ({exc or type(exc).__name__}); "
                       "narrow the ranges in [env.reasoning_gym]") from None


@functools.lru_cache(maxsize=4096)
def _dataset_entry(family: str, config_json: str, index: int) -> tuple[Any, dict[str, Any]]:
    """(the family's dataset, its entry) for a configuration and index: exactly what a task was drawn from."""
    dataset = _dataset(family, config_json)
    try:
        return dataset, dataset[index]
    except Exception as exc:  # noqa: BLE001 - the family's generator, named with what it was asked for
        raise EnvError(f"reasoning_gym:{family} could not generate entry {index} of the configuration "
                       f"{json.loads(config_json)} ({type(exc).__name__}: {exc}); its generator has limits its "
                       "curriculum does not state: narrow the ranges in [env.reasoning_gym]") from exc


SYSTEM_PROMPT_TOOLS = {"calculator": " Use the calculator tool for arithmetic.",
                       "python": " You can run Python code with the python tool."}


class ReasoningGymEnv(ToolAnswerEnv):
    """A reasoning-gym family (or a mix) under ``[env.reasoning_gym]`` settings (see the module docstring)."""

    Settings: ClassVar[type] = Settings
    options: ClassVar[Settings] = Settings()
    families: ClassVar[tuple[str, ...]] = ()
    specs: ClassVar[dict[str, Family]] = {}
    name: ClassVar[str] = "reasoning_gym"
    system_prompt: ClassVar[str] = ""
    context_space: ClassVar[ContextSpace] = ContextSpace([])
    required_data: ClassVar[tuple[str, ...]] = ("family", "config", "index")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A family's class, and each of its configured subclasses (``options``), builds its context space."""
        super().__init_subclass__(**kwargs)
        if not cls.families:
            return
        settings = cls.options
        if settings.weights and len(settings.weights) != len(cls.families):
            raise EnvError(f"[env.reasoning_gym] weights has {len(settings.weights)} numbers for "
                           f"{len(cls.families)} families ({', '.join(cls.families)})")
        cls.specs = {family: family_spec(family, settings, cls.families) for family in cls.families}
        cls.context_space = FamiliesSpace(list(cls.specs.values()), settings.weights or [1.0] * len(cls.families))
        cls.heldout_fraction = settings.heldout_fraction
        cls.system_prompt = _system_prompt(settings)

    @classmethod
    def generate(cls, context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        """One entry of the context's family: (its question, its answer, what regenerates it)."""
        family = context["family"]
        config = cls.specs[family].config(context)
        index = rng.randrange(DATASET_SIZE)
        config_json = json.dumps(config, sort_keys=True)
        _, entry = _dataset_entry(family, config_json, index)
        answer = entry.get("answer")
        data: dict[str, Any] = {"family": family, "config": json.loads(config_json), "index": index}
        expression = (entry.get("metadata") or {}).get("expression")
        if isinstance(expression, str):
            data["expression"] = expression
        return str(entry["question"]), "" if answer is None else str(answer), data

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        if not cls.families:
            raise EnvError("name a reasoning-gym family: env.name = \"reasoning_gym:chain_sum\"")
        return sample_tasks(cls.generate, cls.context_space, split, n, seed, heldout_fraction=cls.heldout_fraction,
                            id_prefix=cls.name)

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        """``train`` and ``heldout``, and ``ood`` where some family has a range past its train range."""
        return ("train", "heldout", "ood") if cls.context_space.has_ood else ("train", "heldout")

    def make_tools(self) -> list[Tool]:
        if self.options.tool == "calculator":
            from ctxrl.tools.calculator import calculator_tool

            return [calculator_tool()]
        if self.options.tool == "python":
            from ctxrl.tools.python import python_tool

            return [python_tool()]
        return []

    @staticmethod
    def entry(task: Task) -> tuple[Any, dict[str, Any]]:
        """(dataset, entry) a task was drawn from."""
        data = task.data
        return _dataset_entry(data["family"], json.dumps(data["config"], sort_keys=True), int(data["index"]))

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        score, extra = self.score_answer(given, task)
        return score >= 1.0, extra

    def score_answer(self, given: str, task: Task) -> tuple[float, dict[str, Any]]:
        """The family's own score of ``given`` on the task's entry (0 where its scorer raises on the text)."""
        dataset, entry = self.entry(task)
        try:
            score = float(dataset.score_answer(given, entry))
        except Exception as exc:  # noqa: BLE001 - a scorer that chokes on the model's text gives no credit
            return 0.0, {"score_error": f"{type(exc).__name__}: {exc}"}
        return (min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0), {"family": task.data["family"]}

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """Answer with the oracle answer; with the calculator offered, first compute the task's expression."""
        if task.answer == "" and cls.entry(task)[1].get("answer") is None:
            raise EnvError(f"reasoning_gym:{task.data['family']} has no single oracle answer (its scorer checks a "
                           "proposed solution), so there is no scripted solution to play")
        answer = f"<answer>{task.answer}</answer>"
        call = _calculator_call(cls, task) if cls.options.tool == "calculator" else None
        return [call, answer] if call else [answer]

    @classmethod
    def shortcut(cls, task: Task) -> list[str]:
        """The oracle answer without the tool: imperfect warm-start demos (``sft.shortcut_fraction``) where a tool
        is offered, the gold solution where none is."""
        return cls.solve(task)[-1:]


def _calculator_call(cls: type, task: Task) -> str | None:
    """A calculator call on the task's recorded expression, where the calculator's value scores 1 as the answer."""
    from ctxrl.tools.calculator import CalculatorError, calculate

    expression = task.data.get("expression")
    if not isinstance(expression, str):
        return None
    expression = expression.replace("×", "*").replace("÷", "/")
    try:
        value = calculate(expression)
    except CalculatorError:
        return None
    dataset, entry = cls.entry(task)
    try:
        agrees = float(dataset.score_answer(value, entry)) >= 1.0
    except Exception:  # noqa: BLE001 - the scorer's trouble means no call, not a failed solution
        return None
    return format_tool_call("calculator", {"expression": expression}) if agrees else None


def _system_prompt(settings: Settings) -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    text = SYSTEM_PROMPTS.get(settings.system_prompt, settings.system_prompt).strip()
    return text + SYSTEM_PROMPT_TOOLS.get(settings.tool, "")
