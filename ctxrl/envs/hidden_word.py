"""The ``hidden_word`` environment: find a hidden word among shown candidates from plain-English letter feedback.

Each task hides a common English word of ``length`` letters and shows ``candidates`` words of that
length, the hidden one among them, in a seeded random order. The ``guess`` tool takes one of the
shown words and says, in English, which of its letters are in the right place, in the word
elsewhere, or not in it (Wordle's marks), and how many guesses are left::

    guess store (word tower) -> store: t (not letter 2), o (not letter 3), r (not letter 4) and e (not letter 5)
                                are in the word elsewhere; s is not in the word. 2 guesses left.
    guess tight (word night) -> tight: i (letter 2), g (letter 3), h (letter 4) and t (letter 5) are in the
                                right place; t is in the word only once. 1 guess left.

Repeated letters count as in Wordle: the letters in the right place are matched first, then each
other copy in the guess, left to right, is "in the word elsewhere" while the word has an unmatched
copy of it left. A copy beyond that is never called "not in the word" (that would be false): the
letter is said to be in the word ``only once`` (``twice``, ``3 times``). The hidden word gets
``night: every letter is in the right place. That is the word.`` A word that is not one of the
shown candidates is an ``Error:`` observation naming the rule, and uses no guess. An attempt has
``guesses`` guesses: the hidden word ends it with reward 1, running out of guesses with 0 (an
``<answer>WORD</answer>`` turn counts as a last guess). Each guess is an action (``guess tight``);
a wrong one failed.

Why it exists: ``codebreak``'s feedback (``=+-``) is symbolic, marks no real model was taught;
this task has the same cross-episode structure (LaMer, MR-Search) in English, which a real
instruct model (SmolLM2-135M) was trained to read and can write notes in. The words come in
families that differ in one letter (``eight fight light might night right sight tight``), and a
task shows the hidden word with ``guesses + 1`` of its family (the other shown words are none
one letter off it). A guess of a near miss rules out little more than itself, so one attempt
often cannot find the word; under ``meta`` trials the same word is hidden in every attempt, and
what the first attempt's feedback proved, carried in a note, can finish the second. The scripted
first attempt (``failure``) guesses near misses in the shown order until its guesses run out;
``reflection`` writes what their feedback proved (``Not the word: tight, light. Known: _ight.
Not in the word: l. Next time: ...``, up to 45 tokens with SmolLM2's tokenizer), which leaves two
shown words; ``solve_after`` reads only the note, keeps the shown words that fit it and guesses
them in the shown order, dropping those each answer rules out.

Context: ``length`` (train 4-5, ood 6), ``candidates`` shown (train 8-12, ood 14-16) and
``guesses`` per attempt (train 2-3, ood 3-4). Measured on 1000 train tasks (seed 0): the scripted
failure never finds the word, ``solve_after`` its note finds it in all 1000, and one attempt that
plays the same way without a note (each guess fits every answer so far) in 51% (on 300 ood tasks:
never, 100% and 65%). ``tests/test_hidden_word.py`` checks the three on 200 train tasks.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.codebreak import feedback
from ctxrl.envs.guesses import GuessBudgetEnv
from ctxrl.envs.registry import register
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.types import Message, Task

# Plain, common English words in families: the words of a line differ in one letter only (``_ight``), so a
# guess of one rules out little more than itself. Each task shows a family's words as its near misses.
FAMILIES: dict[int, tuple[tuple[str, ...], ...]] = {n: tuple(tuple(line.split()) for line in text.strip().splitlines())
                                                    for n, text in {
    4: """bake cake fake lake make rake take wake
          fail hail mail nail pail rail sail tail
          bear dear fear gear hear near pear year
          dine fine line mine nine pine vine wine
          ball call fall hall tall wall
          bell cell sell tell well
          came game name same tame
          book cook hook look took
          cave gave pave save wave
          dice mice nice rice""",
    5: """eight fight light might night right sight tight
          bound found hound mound pound round sound wound
          batch catch hatch latch match patch watch
          score shore snore store swore
          bunch hunch lunch munch punch
          baste haste paste taste waste
          cower lower mower power tower
          shack slack smack snack stack
          dummy gummy mummy tummy yummy
          candy dandy handy sandy
          boast coast roast toast
          couch pouch touch vouch
          brain drain grain train
          goose loose moose noose""",
    6: """bender fender gender lender render sender tender
          bounds hounds mounds pounds rounds sounds wounds
          baking faking making raking taking waking
          caving having paving raving saving waving
          dating eating hating mating rating
          bitter fitter hitter litter sitter
          butter cutter gutter mutter putter
          docket locket pocket rocket socket
          batter hatter latter matter patter
          bather father gather lather rather
          fights lights nights rights sights
          better letter setter wetter
          bellow fellow mellow yellow""",
}.items()}
WORDS: dict[int, tuple[str, ...]] = {n: tuple(w for family in families for w in family)
                                     for n, families in FAMILIES.items()}

_TIMES = {1: "once", 2: "twice"}


def marks(word: str, guess: str) -> str:
    """Per letter of ``guess``: ``=`` right place, ``+`` in the word elsewhere (counting repeats), ``-`` not.
    Wordle's rule, which is codebreak's per-position feedback over letters instead of digits."""
    return feedback(word, guess)


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def describe(guess: str, signs: str) -> str:
    """The English feedback on ``guess`` given its ``marks`` (without the guesses left)."""
    if set(signs) == {"="}:
        return f"{guess}: every letter is in the right place. That is the word."
    placed = [f"{g} (letter {i + 1})" for i, (g, m) in enumerate(zip(guess, signs)) if m == "="]
    elsewhere = [f"{g} (not letter {i + 1})" for i, (g, m) in enumerate(zip(guess, signs)) if m == "+"]
    found = {g for g, m in zip(guess, signs) if m != "-"}
    absent = list(dict.fromkeys(g for g, m in zip(guess, signs) if m == "-" and g not in found))
    capped = list(dict.fromkeys(g for g, m in zip(guess, signs) if m == "-" and g in found))
    clauses = []
    if placed:
        clauses.append(f"{_join(placed)} {'is' if len(placed) == 1 else 'are'} in the right place")
    if elsewhere:
        clauses.append(f"{_join(elsewhere)} {'is' if len(elsewhere) == 1 else 'are'} in the word elsewhere")
    if absent:
        clauses.append(f"{_join(absent)} {'is' if len(absent) == 1 else 'are'} not in the word")
    for g in capped:
        count = sum(1 for c, m in zip(guess, signs) if c == g and m != "-")
        clauses.append(f"{g} is in the word only {_TIMES.get(count, f'{count} times')}")
    return f"{guess}: " + "; ".join(clauses) + "."


def read_feedback(text: str) -> tuple[str, str] | None:
    """``(guess, marks)`` back from a ``guess`` observation (``describe``'s text), or None if it is not one."""
    found = re.match(r"([a-z]+): (.*)", text.strip())
    if found is None:
        return None
    guess, body = found.groups()
    if body.startswith("every letter is in the right place"):
        return guess, "=" * len(guess)
    signs = ["-"] * len(guess)
    for letter, not_, position in re.findall(r"\b([a-z]) \((not )?letter (\d+)\)", body):
        i = int(position) - 1
        if not 0 <= i < len(guess) or guess[i] != letter:
            return None
        signs[i] = "+" if not_ else "="
    return guess, "".join(signs)


def one_letter_off(a: str, b: str) -> bool:
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """The hidden word and ``guesses + 1`` of its family (one letter off it), the rest of the ``candidates``
    other words of the length, none of them one letter off the hidden word; shuffled."""
    length, shown, guesses = int(context["length"]), int(context["candidates"]), int(context["guesses"])
    family = rng.choice([f for f in FAMILIES[length] if len(f) >= guesses + 2])
    near = rng.sample(family, guesses + 2)
    word = near[0]
    others = [w for w in WORDS[length] if w not in family and not one_letter_off(w, word)]
    candidates = near + rng.sample(others, shown - len(near))
    rng.shuffle(candidates)
    prompt = (f"I am thinking of a {length}-letter word. It is one of these {shown} words: "
              f"{', '.join(candidates)}. Find it with the guess tool: you have {guesses} guesses, and each must be "
              "one of these words. After each guess you learn which of its letters are in the right place, which "
              "are in the word elsewhere, and which are not in the word.")
    return prompt, word, {"word": word, "candidates": candidates}


# -- notes: what a failed attempt proved, written for a language model to read ----------------------
def _note(pairs: list[tuple[str, str]], length: int) -> str:
    known: list[str | None] = [None] * length
    elsewhere: set[str] = set()
    for guess, signs in pairs:
        for i, (g, m) in enumerate(zip(guess, signs)):
            if m == "=":
                known[i] = g
            elif m == "+":
                elsewhere.add(g)
    present = {k for k in known if k} | elsewhere
    absent = {g for guess, signs in pairs for g, m in zip(guess, signs) if m == "-" and g not in present}
    tried = list(dict.fromkeys(g for g, s in pairs if s != "=" * length))
    parts = [f"Not the word: {', '.join(tried)}."] if tried else []
    parts.append("Known: " + "".join(k or "_" for k in known) + ".")
    if elsewhere:
        parts.append(f"Also in the word: {', '.join(sorted(elsewhere))}.")
    if absent:
        parts.append(f"Not in the word: {', '.join(sorted(absent))}.")
    return " ".join(parts)


def _letters(note: str, label: str) -> list[str]:
    found = re.search(rf"{label}: ([a-z, ]+)\.", note)
    return re.findall(r"[a-z]+", found.group(1)) if found else []


def fits_note(word: str, note: str) -> bool:
    """Whether ``word`` agrees with everything ``note`` (``reflection``'s text) says."""
    if word in _letters(note, "Not the word"):
        return False
    pattern = re.search(r"Known: ([a-z_]+)\.", note)
    if pattern and (len(pattern.group(1)) != len(word)
                    or any(k not in ("_", w) for k, w in zip(pattern.group(1), word))):
        return False
    return (all(g in word for g in _letters(note, "Also in the word"))
            and not any(g in word for g in _letters(note, "Not in the word")))


@register("hidden_word")
class HiddenWordEnv(GuessBudgetEnv):
    """Find a hidden word among the shown candidates through the ``guess`` tool's English feedback."""

    name: ClassVar[str] = "hidden_word"
    system_prompt: ClassVar[str] = 'Find the hidden word with the guess tool, e.g. word "crane".'
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("length", "int", low=4, high=5, default=5, ood_low=6, ood_high=6,
                     description="letters in the word"),
        ContextParam("candidates", "int", low=8, high=12, default=10, ood_low=14, ood_high=16,
                     description="words shown, the hidden one among them"),
        ContextParam("guesses", "int", low=2, high=3, default=2, ood_low=3, ood_high=4,
                     description="guesses per attempt"),
    ])
    required_data: ClassVar[tuple[str, ...]] = ("word", "candidates")
    hidden: ClassVar[str] = "word"
    names_actions: ClassVar[bool] = True
    generate = staticmethod(generate)

    def make_tools(self) -> list[Tool]:
        return [Tool(name="guess", description="Guess the hidden word (one of the shown candidates); says which "
                     "letters are in the right place, in the word elsewhere, or not in it.",
                     parameters={"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
                     fn=self._guess, timeout_s=5.0)]

    def _guess(self, word: str) -> str:
        if self._task is None:
            raise EnvError("guess before reset")
        word = str(word).strip().lower()
        candidates = self._task.data["candidates"]
        if word not in candidates:
            raise ValueError(f"a guess must be one of the {len(candidates)} words shown in the task; got {word!r}")
        left = self.spend_guess(f"guess {word}", solved=word == self._task.data["word"])
        text = describe(word, marks(self._task.data["word"], word))
        if self._solved:
            return text
        return f"{text} {left or 'No'} guess{'' if left == 1 else 'es'} left."

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return given.strip().lower() == task.data["word"], {}

    # -- scripted attempts ---------------------------------------------------------------------------
    @staticmethod
    def _data(task: Task) -> tuple[str, list[str]]:
        if "word" not in task.data or "candidates" not in task.data:
            raise EnvError(f"task {task.id} has no data['word'] and data['candidates']; draw hidden_word tasks with "
                           "sample_tasks")
        return task.data["word"], list(task.data["candidates"])

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """The oracle: the word, guessed at once."""
        word, _ = cls._data(task)
        return [format_tool_call("guess", {"word": word})]

    @classmethod
    def failure(cls, task: Task) -> list[str]:
        """A first attempt that guesses the shown words one letter off the hidden one (its near misses), in the
        shown order, until its guesses run out: each rules out little more than itself, and none is the word."""
        word, candidates = cls._data(task)
        near = [c for c in candidates if one_letter_off(c, word)]
        others = [c for c in candidates if c != word and c not in near]
        return [format_tool_call("guess", {"word": c}) for c in (near + others)[:task.context["guesses"]]]

    @classmethod
    def reflection(cls, task: Task, messages: list[Message]) -> str:
        """What an attempt's feedback proved, from its observations: the words ruled out, the letters known in
        place, the letters in the word elsewhere and those not in it."""
        pairs = [found for m in messages if m.role == "tool" and (found := read_feedback(m.content)) is not None]
        pairs = [(g, s) for g, s in pairs if len(g) == task.context["length"]]
        if not pairs:
            return "No valid guess. Next time: guess one of the shown words every turn."
        return _note(pairs, task.context["length"]) + " Next time: guess a shown word that fits all of this."

    @classmethod
    def solve_after(cls, task: Task, reflection: str) -> list[str]:
        """A second attempt that follows the note: of the shown words, those that fit it, guessed in the shown
        order; each answer's feedback drops the words it rules out before the next guess."""
        word, candidates = cls._data(task)
        left = [c for c in candidates if fits_note(c, reflection)] or candidates
        guessed: list[str] = []
        for _ in range(task.context["guesses"]):
            guessed.append(left[0])
            if left[0] == word:
                break
            seen = marks(word, left[0])
            # (only a note that ruled the word out can leave no shown word consistent: then any not yet guessed)
            left = ([c for c in left if c not in guessed and marks(c, guessed[-1]) == seen]
                    or [c for c in candidates if c not in guessed])
        return [format_tool_call("guess", {"word": g}) for g in guessed]
