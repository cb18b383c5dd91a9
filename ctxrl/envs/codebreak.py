"""The ``codebreak`` environment: find a hidden code from per-position feedback, with few guesses per attempt.

Each task hides a code of ``length`` digits, each from 1 to ``symbols`` (repeats allowed). The
``guess`` tool takes a code and answers, position by position, ``=`` (right digit here), ``+``
(the digit is in the code elsewhere) or ``-`` (not in the code): ``guess 1123 -> =-+-``. An
attempt has ``guesses`` guesses; the exact code ends it with reward 1, running out with 0.

Why it exists: it is a task where a failed attempt reveals what the next one needs, and a note
can carry it (the setting of cross-episode meta-RL: LaMer, ORBIT's hidden-information tasks). With
fewer guesses than symbols, one attempt often cannot find every digit; under ``meta`` trials the
same code is hidden in every attempt, so what the first attempt's feedback showed (which digit
sits where, which digits are absent) can finish the second. The scripted first attempt
(``failure``) probes one digit at a time (``1111``, ``2222``, ...); ``reflection`` writes what the
feedback proved (``Known: 3_1_. Not in the code: 2.``) and ``solve_after`` finishes from the note:
the known digits in place, the unknown positions probed with digits not yet ruled out.

Context: ``length`` (train 3-4, ood 5), ``symbols`` (train 4-6, ood 7-8) and ``guesses`` per
attempt (train 3-4, ood 4-5). Reward: 1 for guessing the code within the attempt's guesses, else 0
(an ``<answer>CODE</answer>`` turn counts as a last guess). Each guess is an action
(``guess 1123``); one whose feedback is not all ``=`` failed.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.guesses import GuessBudgetEnv
from ctxrl.envs.registry import register
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.types import Message, Task


def feedback(code: str, guess: str) -> str:
    """Per position: ``=`` right digit, ``+`` the digit is elsewhere in the code (counting repeats), ``-`` not."""
    marks = ["-"] * len(code)
    left: dict[str, int] = {}
    for i, (c, g) in enumerate(zip(code, guess)):
        if c == g:
            marks[i] = "="
        else:
            left[c] = left.get(c, 0) + 1
    for i, (c, g) in enumerate(zip(code, guess)):
        if c != g and left.get(g, 0) > 0:
            marks[i] = "+"
            left[g] -= 1
    return "".join(marks)


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    length, symbols, guesses = int(context["length"]), int(context["symbols"]), int(context["guesses"])
    code = "".join(str(rng.randint(1, symbols)) for _ in range(length))
    prompt = (f"A hidden code has {length} digits, each from 1 to {symbols}. Find it with the guess tool: you have "
              f"{guesses} guesses. Feedback per position: = right, + elsewhere in the code, - not in the code.")
    return prompt, code, {"code": code}


def knowledge(length: int, guesses: list[tuple[str, str]]) -> tuple[list[str | None], set[str]]:
    """What ``(guess, feedback)`` pairs prove: the digit at each position (or None), and digits not in the code."""
    known: list[str | None] = [None] * length
    present: set[str] = set()
    for guess, marks in guesses:
        for i, (g, m) in enumerate(zip(guess, marks)):
            if m == "=":
                known[i] = g
            if m in "=+":
                present.add(g)
    absent = {g for guess, marks in guesses for g, m in zip(guess, marks) if m == "-" and g not in present}
    return known, absent


def _note(known: list[str | None], absent: set[str]) -> str:
    text = "Known: " + "".join(k or "_" for k in known) + "."
    if absent:
        text += " Not in the code: " + ", ".join(sorted(absent)) + "."
    return text


def _read_note(note: str, length: int) -> tuple[list[str | None], set[str]]:
    known: list[str | None] = [None] * length
    found = re.search(r"Known: ([0-9_]+)", note)
    if found and len(found.group(1)) == length:
        known = [None if ch == "_" else ch for ch in found.group(1)]
    absent_text = re.search(r"Not in the code: ([0-9, ]+)", note)
    absent = set(re.findall(r"\d", absent_text.group(1))) if absent_text else set()
    return known, absent


@register("codebreak")
class CodebreakEnv(GuessBudgetEnv):
    """Find a hidden code through the ``guess`` tool's per-position feedback, within ``guesses`` guesses."""

    name: ClassVar[str] = "codebreak"
    system_prompt: ClassVar[str] = 'Find the hidden code with the guess tool, e.g. code "1234".'
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("length", "int", low=3, high=4, default=3, ood_low=5, ood_high=5,
                     description="digits in the code"),
        ContextParam("symbols", "int", low=4, high=6, default=5, ood_low=7, ood_high=8,
                     description="each digit is 1..symbols"),
        ContextParam("guesses", "int", low=3, high=4, default=3, ood_low=4, ood_high=5,
                     description="guesses per attempt"),
    ])
    required_data: ClassVar[tuple[str, ...]] = ("code",)
    hidden: ClassVar[str] = "code"
    names_actions: ClassVar[bool] = True
    generate = staticmethod(generate)

    def make_tools(self) -> list[Tool]:
        return [Tool(name="guess", description="Guess the code; returns per-position feedback (= + -).",
                     parameters={"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                     fn=self._guess, timeout_s=5.0)]

    def _guess(self, code: str) -> str:
        if self._task is None:
            raise EnvError("guess before reset")
        code = re.sub(r"\s", "", str(code))
        length, symbols = self._task.context["length"], self._task.context["symbols"]
        if len(code) != length or any(not ch.isdigit() or not 1 <= int(ch) <= symbols for ch in code):
            raise ValueError(f"a guess is {length} digits, each 1..{symbols}; got {code!r}")
        marks = feedback(self._task.data["code"], code)
        left = self.spend_guess(f"guess {code}", solved=marks == "=" * length)
        return f"{marks} ({left} guesses left)"

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return re.sub(r"\s", "", given) == task.data["code"], {}

    # -- scripted attempts ---------------------------------------------------------------------------
    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """The oracle: the code, guessed at once."""
        if "code" not in task.data:
            raise EnvError(f"task {task.id} has no data['code']; draw codebreak tasks with sample_tasks")
        return [format_tool_call("guess", {"code": task.data["code"]})]

    @classmethod
    def failure(cls, task: Task) -> list[str]:
        """A first attempt that probes one digit at a time (1111, 2222, ...) until its guesses run out; it never
        finds the code."""
        if "code" not in task.data:
            raise EnvError(f"task {task.id} has no data['code']; draw codebreak tasks with sample_tasks")
        length, guesses, symbols = task.context["length"], task.context["guesses"], task.context["symbols"]
        code = task.data["code"]
        # (a code of one repeated digit would be found by its probe: probe the digits after it instead)
        digits = [d for d in range(1, symbols + 1) if str(d) * length != code][:guesses]
        # Every guess is used, so the attempt ends by running out of them: with as few symbols as
        # guesses and a one-digit code skipped, the last probe is repeated (it cannot find the code).
        digits += digits[-1:] * (guesses - len(digits))
        return [format_tool_call("guess", {"code": str(d) * length}) for d in digits]

    @classmethod
    def reflection(cls, task: Task, messages: list[Message]) -> str:
        """What an attempt's feedback proved, from its conversation: the known digits and the absent ones."""
        pairs = []
        for i, m in enumerate(messages):
            if m.role == "assistant" and m.tool_calls and i + 1 < len(messages):
                reply = messages[i + 1].content
                marks = reply.split(" ")[0]
                guess = re.sub(r"\s", "", str(m.tool_calls[0].arguments.get("code", "")))
                if set(marks) <= set("=+-") and len(marks) == len(guess) == task.context["length"]:
                    pairs.append((guess, marks))
        if not pairs:
            return "No valid guess. Next time: guess a code of the right length every turn."
        known, absent = knowledge(task.context["length"], pairs)
        return _note(known, absent) + " Next time: keep the known digits and try the others."

    @classmethod
    def solve_after(cls, task: Task, reflection: str) -> list[str]:
        """A second attempt that follows the note: the known digits kept, every unknown position probed with the
        next digit not yet tried or ruled out (``1111``-style probing shows exactly where that digit sits), so the
        last probe is the code once every other digit is placed."""
        length, symbols, guesses = task.context["length"], task.context["symbols"], task.context["guesses"]
        code = task.data["code"]
        known, tried = _read_note(reflection, length)
        tried |= {k for k in known if k is not None}  # a probed digit's every position is known
        texts = []
        for _ in range(guesses):
            digit = next((str(d) for d in range(1, symbols + 1) if str(d) not in tried), "1")
            guess = "".join(k if k is not None else digit for k in known)
            texts.append(format_tool_call("guess", {"code": guess}))
            marks = feedback(code, guess)
            if marks == "=" * length:
                break
            known = [k if k is not None else (digit if m == "=" else None) for k, m in zip(known, marks)]
            tried.add(digit)
        return texts
