"""The ``calculator`` environment: arithmetic word problems solved with a calculator tool.

Each task is two to three numbers joined by ``+``, ``-`` or ``*``, written in words in one of
four short templates::

    What is 37 plus 58 times 4?
    Compute 37 minus 58.
    Find the value of 6 times 7 plus 2.
    Ann has 37 coins. She gets 58 more, then gives away 12. How many coins does she have now?

The wording is deliberately small and regular, because the first policy trained on it is a
~1M-parameter transformer that must learn to *transcribe* the words into ``37 + 58 - 12``:
each word maps to exactly one operator (plus/gets..more -> ``+``, minus/gives away -> ``-``,
times -> ``*``) and the numbers appear in the order of the expression. The gold answer is the
expression's value with standard precedence; the story template is only used when it has no
``*`` and never goes below zero, so its everyday meaning agrees with that value.

Context: ``digits`` per number (train 1-3, ood 4) and ``ops``, the number of operations
(1-2 everywhere), so the OOD split tests longer numbers only.

An episode: the model calls the tool (reward 0, observation = the value), then writes
``<answer>N</answer>`` (reward 1 if numerically equal to the gold answer, else 0; episode ends).
"""

from __future__ import annotations

import json
import random
import re
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv, parse_answer  # noqa: F401 - parse_answer is re-exported
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.tools.calculator import calculate, calculator_tool
from ctxrl.types import Task

OPERATORS = ("+", "-", "*")
MATH_WORDS = {"+": "plus", "-": "minus", "*": "times"}
MATH_TEMPLATES = ("What is {words}?", "Compute {words}.", "Find the value of {words}.")
STORY_PEOPLE = (("Ann", "She", "she"), ("Ben", "He", "he"), ("Eva", "She", "she"), ("Tom", "He", "he"))
STORY_ITEMS = ("coins", "apples", "cards", "stamps")
STORY_STEPS = {"+": "gets {n} more", "-": "gives away {n}"}

_NUMBER = re.compile(r"^[+-]?\d+(?:\.\d+)?$")


def answers_equal(given: str, gold: str) -> bool:
    """Numeric equality, so ``" 42 "``, ``"42.0"`` and ``"+42"`` all match ``"42"``."""
    given = given.strip()
    if not _NUMBER.match(given):
        return False
    try:
        return Decimal(given) == Decimal(gold.strip())
    except InvalidOperation:
        return False


def _story(numbers: list[int], ops: list[str], rng: random.Random) -> str:
    name, pronoun, pronoun_lower = rng.choice(STORY_PEOPLE)
    item = rng.choice(STORY_ITEMS)
    steps = ", then ".join(STORY_STEPS[op].format(n=n) for op, n in zip(ops, numbers[1:]))
    return (f"{name} has {numbers[0]} {item}. {pronoun} {steps}. "
            f"How many {item} does {pronoun_lower} have now?")


def _story_fits(numbers: list[int], ops: list[str]) -> bool:
    """Only +/- and a running total that never goes negative: the story means the expression."""
    total = numbers[0]
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            return False
        total = total + n if op == "+" else total - n
        if total < 0:
            return False
    return True


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """One word problem for ``context``: ``(prompt, answer, {"expression", "template"})``."""
    digits, n_ops = int(context["digits"]), int(context["ops"])
    numbers = [rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(n_ops + 1)]
    ops = [rng.choice(OPERATORS) for _ in range(n_ops)]
    expression = " ".join([str(numbers[0])] + [f"{op} {n}" for op, n in zip(ops, numbers[1:])])
    templates = list(MATH_TEMPLATES) + (["story"] if _story_fits(numbers, ops) else [])
    template = rng.choice(templates)
    if template == "story":
        prompt = _story(numbers, ops, rng)
    else:
        words = " ".join([str(numbers[0])] + [f"{MATH_WORDS[op]} {n}" for op, n in zip(ops, numbers[1:])])
        prompt = template.format(words=words)
    return prompt, calculate(expression), {"expression": expression, "template": template}


@register("calculator")
class CalculatorEnv(ToolAnswerEnv):
    """Arithmetic word problems; reward 1 for the right ``<answer>``, tool use expected."""

    name: ClassVar[str] = "calculator"
    system_prompt: ClassVar[str] = "Use the calculator tool for arithmetic. Reply with <answer>N</answer>."
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("digits", "int", low=1, high=3, default=2, ood_low=4, ood_high=4,
                     description="digits in every number of the problem"),
        ContextParam("ops", "int", low=1, high=2, default=1, ood_low=1, ood_high=2,
                     description="number of operations (+, -, *)"),
    ])

    generate = staticmethod(generate)

    def make_tools(self) -> list[Tool]:
        return [calculator_tool()]

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict]:
        return answers_equal(given, task.answer), {}

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """Call the calculator on the task's expression, then answer with its value."""
        expression = task.data.get("expression")
        if not isinstance(expression, str):
            raise EnvError(f"task {task.id} has no data['expression']; calculator tasks need it to be solved")
        return [format_tool_call("calculator", {"expression": expression}), f"<answer>{task.answer}</answer>"]

    @classmethod
    def shortcut(cls, task: Task) -> list[str]:
        """A right answer without the tool: material for deliberately imperfect demos."""
        return [f"<answer>{task.answer}</answer>"]

    @classmethod
    def corpus(cls, n: int, seed: int) -> list[str]:
        """Plain-text transcripts of ``n`` solved train tasks (plus the prompts' fixed text).

        Used to train the tiny model's tokenizer and to pre-train it, so that it can copy numbers
        and map words to operators the way any real pretrained model can. Each text holds a
        whole solved task, so copying happens inside one sequence. Only train tasks are used:
        held-out prompts never shape the vocabulary or the pre-training.
        """
        tool = calculator_tool()
        texts = [cls.system_prompt, json.dumps(tool.schema()),
                 "Error: tool calculator raised CalculatorError: division by zero"]
        for task in cls.sample_tasks("train", n, seed):
            call, answer = cls.solve(task)
            texts.append(f"{task.prompt}\n{call}\n{TOOL_RESPONSE_OPEN}\n{task.answer}\n{TOOL_RESPONSE_CLOSE}\n{answer}")
        return texts
