"""The ``python_math`` environment: number problems that need computation, solved with Python.

ReTool / SimpleTIR style: the answer is out of reach of mental arithmetic (a sum of thousands of
squares, a count of primes, a digit sum of a factorial, a large Fibonacci number modulo m), and
the ``python`` tool runs the model's code in the sandbox (``ctxrl.tools.sandbox``). The episode:
the model calls ``python`` as often as it likes (each call's printed output is the observation),
then answers ``<answer>...</answer>``; reward 1 if the answer equals the gold value.

Answers are compared as mathematics, not strings (``answers_equivalent``): numbers in any
notation (``1,234``, ``1234.0``, ``\\boxed{1234}``, ``2468/2``) and simple expressions (``2^10``,
``sqrt(16)``) are evaluated with sympy after a strict character check, so nothing the model
writes is ever executed as Python.

Context: ``family`` (which kind of problem) and ``scale`` (train 1-3, ood 4-5), which sets the
size of the numbers.

Imperfect warm-start scripts: ``shortcut`` answers without running code
(``sft.shortcut_fraction``); ``redundant`` runs the code twice before answering
(``sft.redundant_fraction``), a policy with a call to spare for OTC's reward to cut.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.tools.python import python_tool
from ctxrl.types import Task

FAMILIES = ("sum_squares", "count_primes", "factorial_digit_sum", "fibonacci_mod")
_SAFE = re.compile(r"^[0-9+\-*/^().\s]*(sqrt|pi|[0-9+\-*/^().\s])*$")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _value(text: str):
    """A sympy number for ``text``, or None when it is not a plain mathematical expression."""
    import sympy

    text = text.strip().strip("$").replace(",", "").replace("\\cdot", "*").replace("\\times", "*")
    boxed = _BOXED.findall(text)
    if boxed:
        text = boxed[-1]
    if not text or len(text) > 200 or not _SAFE.match(text):
        return None
    text = text.replace("**", "^")
    powers = re.findall(r"\^\s*\(?\s*(\d+)", text)
    if text.count("^") > 1 or any(len(p) > 4 for p in powers):  # 9^9^9 would never finish
        return None
    try:
        value = sympy.sympify(text.replace("^", "**"), rational=True)
    except (sympy.SympifyError, SyntaxError, TypeError, ValueError, ZeroDivisionError):
        return None
    return value if value.is_number and value.is_finite and value.is_real else None


def answers_equivalent(given: str, gold: str) -> bool:
    """Whether two answers denote the same number (exact for rationals, 1e-9 relative otherwise)."""
    a, b = _value(given), _value(gold)
    if a is None or b is None:
        return False
    import sympy

    if a.is_rational and b.is_rational:
        return bool(sympy.Eq(a, b))
    return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))


def _fib_mod(n: int, m: int) -> int:
    """F(n) mod m by fast doubling (the reference code in the task loops; the gold answer must not)."""
    def pair(k: int) -> tuple[int, int]:
        if k == 0:
            return 0, 1
        a, b = pair(k >> 1)
        c, d = a * ((2 * b - a) % m) % m, (a * a + b * b) % m
        return (d, (c + d) % m) if k & 1 else (c, d)

    return pair(n)[0]


def _problem(family: str, scale: int, rng: random.Random) -> tuple[str, int, str]:
    """(prompt, answer, Python code that computes it)."""
    if family == "sum_squares":
        n = rng.randrange(10 ** (scale + 1), 10 ** (scale + 2))
        return (f"What is the sum of the squares of the integers from 1 to {n}?", n * (n + 1) * (2 * n + 1) // 6,
                f"print(sum(i * i for i in range(1, {n} + 1)))")
    if family == "count_primes":
        n = rng.randrange(10 ** (scale + 1), 3 * 10 ** (scale + 1))
        sieve = bytearray([1]) * n
        sieve[:2] = b"\x00\x00"
        for i in range(2, math.isqrt(n - 1) + 1):
            if sieve[i]:
                sieve[i * i::i] = bytearray(len(range(i * i, n, i)))
        code = (f"n = {n}\nsieve = [True] * n\nsieve[0] = sieve[1] = False\n"
                "for i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n"
                "        sieve[i * i::i] = [False] * len(range(i * i, n, i))\nprint(sum(sieve))")
        return f"How many prime numbers are less than {n}?", sum(sieve), code
    if family == "factorial_digit_sum":
        n = rng.randrange(10 * scale, 40 * scale)
        return (f"What is the sum of the digits of {n}! ({n} factorial)?", sum(map(int, str(math.factorial(n)))),
                f"import math\nprint(sum(int(d) for d in str(math.factorial({n}))))")
    if family == "fibonacci_mod":
        n = rng.randrange(10 ** (scale + 1), 10 ** (scale + 2))
        m = rng.choice((997, 1009, 10007, 65537))
        return (f"Let F(0) = 0, F(1) = 1 and F(k) = F(k-1) + F(k-2). What is F({n}) modulo {m}?", _fib_mod(n, m),
                f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, (a + b) % {m}\nprint(a)")
    raise EnvError(f"unknown python_math family {family!r}; one of {FAMILIES}")


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    prompt, answer, code = _problem(str(context["family"]), int(context["scale"]), rng)
    return prompt, str(answer), {"code": code}


@register("python_math")
class PythonMathEnv(ToolAnswerEnv):
    """Number problems solved by running Python in the sandbox; reward 1 for the right answer."""

    name: ClassVar[str] = "python_math"
    system_prompt: ClassVar[str] = "Use the python tool to compute. Reply with <answer>N</answer>."
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("family", "choice", choices=FAMILIES, default="sum_squares", description="kind of problem"),
        ContextParam("scale", "int", low=1, high=3, default=2, ood_low=4, ood_high=5,
                     description="size of the numbers (the answer is out of reach of mental arithmetic)"),
    ])

    required_data: ClassVar[tuple[str, ...]] = ("code",)
    generate = staticmethod(generate)

    def make_tools(self) -> list[Tool]:
        return [python_tool(timeout_s=10.0)]

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return answers_equivalent(given, task.answer), {}

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """Run the reference code, then answer with the printed value."""
        code = task.data.get("code")
        if not isinstance(code, str):
            raise EnvError(f"task {task.id} has no data['code']; python_math tasks need it to be solved")
        return [format_tool_call("python", {"code": code}), f"<answer>{task.answer}</answer>"]

    @classmethod
    def shortcut(cls, task: Task) -> list[str]:
        """The right answer without running code: material for deliberately imperfect demos.

        No model can do these sums in its head, so a warm start on such demos learns to guess a
        number; RL has to move it to the tool.
        """
        return [f"<answer>{task.answer}</answer>"]

    @classmethod
    def redundant(cls, task: Task) -> list[str]:
        """Run the reference code twice, then answer: right, with one call too many (sft.redundant_fraction).

        Rerunning code whose output is already on screen is the over-calling OTC's reward cuts.
        """
        call, answer = cls.solve(task)
        return [call, call, answer]

    @classmethod
    def pretraining_variant(cls, seed: int) -> type[PythonMathEnv]:
        """For pre-training text: the reference code's output is known, so it is replayed, not run.

        Thousands of pre-training episodes would otherwise start thousands of sandboxes (minutes).
        The observation is the one the sandbox gives for that code (tested); any other code runs.
        """
        return ReplayedPythonMathEnv


class ReplayedPythonMathEnv(PythonMathEnv):
    """``python_math`` whose tool answers the task's reference code from the known answer (pre-training only)."""

    def make_tools(self) -> list[Tool]:
        sandboxed = python_tool(timeout_s=10.0)

        async def run(code: str) -> str:
            task = self._task
            if task is not None and code == task.data.get("code"):
                return str(task.answer)  # what ``print(answer)`` shows, as format_result renders it
            return await sandboxed.fn(code=code)

        return [dataclasses.replace(sandboxed, fn=run)]
