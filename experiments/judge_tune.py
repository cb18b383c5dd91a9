"""Fine-tune a small model into a one-word judge for a rubric, and measure it before and after.

SmolLM2-135M-Instruct, asked as ``examples/rubrics/answer_matches_reference.toml`` whether a calculator answer
matches the reference, gives no verdict in its greedy reply and Yes to nearly everything when sampled
(docs/judges.md), so RL rewarded by it learns nothing. This script teaches such a model the rubric's verdict (on an
H200, 300 steps made SmolLM2 right on 399 of 400 held-out answers):

1. **Examples.** Tasks from an environment's train split (its own ``sample_tasks``), each made into a pair: the
   environment's gold final message (the last turn of its ``solve``), labelled with the rubric's accepting word,
   and the same message with the reference answer replaced by a plausible wrong one (``WRONG_KINDS``: off by one,
   a digit changed, the sign flipped, another task's answer, empty, not a number; a letter changed in a word),
   labelled with its rejecting word. Half of the examples say yes, half no.
2. **The prompt the judge will see.** Each example is an episode ending in that final message, asked through
   ``Judge.question`` (``reward.judge.input=answer``, ``reward.judge.reference=true``) and rendered by the judge's
   own ``LocalBackend`` (the model's chat template through ctxrl's guarded renderer): the ids are those a run's
   judge is prompted with. The completion is the verdict word (``Yes``) and the end-of-turn token, as if sampled.
3. **Fine-tuning.** The named model (any ``model.name``: ``smollm2-135m-instruct``, a ``tiny:...`` model, a
   checkpoint directory), loaded by ctxrl's loader (GGUF conversion and end-of-turn fixes included), trains on the
   completion tokens only (the prompt's loss mask is 0): token-mean negative log-likelihood, AdamW (float32 master
   weights under bfloat16, ``ctxrl.learner.precision``), linear warm-up over 5% of the steps then cosine decay,
   gradients clipped at 1. Saved with its tokenizer and chat template as an HF checkpoint directory that
   ``reward.judge.target=DIR`` loads.
4. **Evaluation.** Before and after, the judge's first reply (greedy, ``--max-tokens``, as ``Judge`` asks first) to
   held-out examples: tasks no training example has. Accuracy (a reply without a verdict counts as wrong), the
   fraction of replies without a verdict, and the rate of accepting verdicts on yes and on no examples (and on each
   kind of wrong answer). The "after" figures are the saved directory's, loaded again as a judge.

    python experiments/judge_tune.py --model tiny:pretrain_steps=0 --examples 64 --eval-examples 16 --steps 20 \\
        --batch-size 8 --lr 3e-3 --max-tokens 4 --save runs/judge-tiny            # CPU, under a minute
    python experiments/judge_tune.py --model smollm2-135m-instruct --examples 2000 --steps 300 --lr 5e-5 \\
        --batch-size 32 --device cuda --dtype bfloat16 --save runs/judge            # a GPU

What it does not do: judge transcripts (``reward.judge.input=transcript``) or score-line rubrics (a rubric needs
``[labels]``), read an environment's settings (it uses the environment's defaults), or make wrong answers for an
environment whose final message does not state its reference answer (a puzzle solved by moves): it says so.
Labels come from how each answer was made, not from the environment's verifier.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from ctxrl.errors import ConfigError, CtxrlError
from ctxrl.types import Episode, Message, Task

WRONG_KINDS = ("off_by_one", "digit", "sign", "other_task", "empty", "not_a_number", "character")
"""How a no example's answer is wrong. A kind that does not apply to a reference is skipped for it: ``off_by_one``,
``sign`` and ``not_a_number`` need a number (``sign`` one other than 0), ``digit`` a digit, ``character`` a
letter."""
NOT_NUMBERS = ("N", "unknown", "I cannot tell", "the answer", "none")
"""What a policy writes instead of a number (``N`` is the calculator's own placeholder, ``<answer>N</answer>``)."""
MARKER = "judge_tune.json"
"""The report written into ``--save``: a directory holding one is this script's to write again."""
_NUMBER = re.compile(r"^[+-]?\d+(?:\.\d+)?$")


# -- examples ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JudgeExample:
    """A task, the final message the judge reads, and whether that message's answer matches the reference."""

    task: Task
    answer: str
    label: bool
    kind: str
    """``match``, or one of ``WRONG_KINDS``."""


def answer_frame(env_cls: type, task: Task) -> tuple[str, str]:
    """The environment's gold final message for ``task`` (the last turn of its ``solve``) cut around the last copy of
    the reference answer standing alone (not inside a longer number or word): ``(before, after)``, so that the
    message with answer ``a`` is ``before + a + after``."""
    from ctxrl.chat.toolcalls import HERMES

    final = env_cls.solve(task)[-1]
    reference = task.answer.strip()
    fix = ("judge_tune writes right and wrong answers into the message that ends an episode, so it needs an "
           "environment that ends with a stated answer (calculator, python_math, kv_chain, search_qa, fact_hunt)")
    calls, errors = HERMES.parse(final)  # (environments write their solutions' calls in the Hermes format)
    if calls or errors:
        raise ConfigError(f"the final message of {env_cls.__name__}.solve(task {task.id}) is a tool call "
                          f"({final[:120]!r}): its episodes end by a tool, not by an answer; {fix}")
    found = list(re.finditer(rf"(?<![\w.]){re.escape(reference)}(?![\w.])", final)) if reference else []
    if not found:
        raise ConfigError(f"the final message of {env_cls.__name__}.solve(task {task.id}) is {final[:200]!r}, which "
                          f"does not state the task's reference answer {task.answer!r}; {fix}")
    return final[:found[-1].start()], final[found[-1].end():]


def differs(answer: str, reference: str) -> bool:
    """Whether ``answer`` is not the reference: as numbers when both are, else as text (case and spaces aside)."""
    if _NUMBER.match(answer.strip()) and _NUMBER.match(reference.strip()):
        return Decimal(answer) != Decimal(reference)
    return answer.strip().lower() != reference.strip().lower()


def wrong_answer(reference: str, others: list[str], rng: random.Random) -> tuple[str, str]:
    """A plausible wrong answer to ``reference`` and its kind (``WRONG_KINDS``), the kind drawn uniformly among
    those that give an answer different from the reference; ``others``: other tasks' answers."""
    reference = reference.strip()
    number = Decimal(reference) if _NUMBER.match(reference) else None

    def off_by_one() -> str | None:
        return None if number is None else str(number + rng.choice((-1, 1)))

    def digit() -> str | None:
        runs = list(re.finditer(r"\d+", reference))
        if not runs:
            return None
        run = rng.choice(runs)
        i = rng.randrange(run.start(), run.end())
        leading = i == run.start() and run.end() - run.start() > 1  # (never "042": it is 42)
        choices = [d for d in "0123456789" if d != reference[i] and not (leading and d == "0")]
        return reference[:i] + rng.choice(choices) + reference[i + 1:]

    def sign() -> str | None:
        return None if number is None or number == 0 else str(-number)

    def other_task() -> str | None:
        candidates = [o for o in others if differs(o, reference)]
        return rng.choice(candidates) if candidates else None

    def character() -> str | None:
        places = [i for i, c in enumerate(reference) if c.isalpha()]
        if not places:
            return None
        i = rng.choice(places)
        choices = [c for c in "abcdefghijklmnopqrstuvwxyz" if c != reference[i].lower()]
        return reference[:i] + rng.choice(choices) + reference[i + 1:]

    makers = {"off_by_one": off_by_one, "digit": digit, "sign": sign, "other_task": other_task,
              "empty": lambda: "", "not_a_number": lambda: None if number is None else rng.choice(NOT_NUMBERS),
              "character": character}
    kinds = list(WRONG_KINDS)
    rng.shuffle(kinds)
    for kind in kinds:
        answer = makers[kind]()
        if answer is not None and differs(answer, reference):
            return answer, kind
    raise AssertionError("unreachable: an empty answer differs from a non-empty reference")


def make_examples(env_cls: type, tasks: list[Task], n: int, seed: int) -> list[JudgeExample]:
    """``n`` examples from the first ``ceil(n / 2)`` of ``tasks``: each task's gold final message (yes) and the same
    message with a wrong answer (no); the last pair is cut to one (yes) when ``n`` is odd."""
    rng = random.Random(seed)
    pool = [t.answer.strip() for t in tasks]
    out: list[JudgeExample] = []
    for task in tasks[:math.ceil(n / 2)]:
        before, after = answer_frame(env_cls, task)
        wrong, kind = wrong_answer(task.answer, pool, rng)
        out += [JudgeExample(task, before + task.answer.strip() + after, True, "match"),
                JudgeExample(task, before + wrong + after, False, kind)]
    return out[:n]


def draw_tasks(env_cls: type, env: str, split: str, n: int, seed: int, *,
               avoid: set[str] | frozenset[str] = frozenset()) -> list[Task]:
    """``n`` tasks of ``split`` whose prompts are not in ``avoid`` (the training tasks'), distinct by prompt."""
    from ctxrl.envs.hooks import available_splits

    if split not in available_splits(env_cls):
        raise ConfigError(f"{env} has no {split!r} tasks (it has {', '.join(available_splits(env_cls))}); choose "
                          "another --eval-split")
    drawn = env_cls.sample_tasks(split, 2 * n + len(avoid), seed)
    seen, out = set(avoid), []
    for task in drawn:
        if task.prompt not in seen:
            seen.add(task.prompt)
            out.append(task)
    if len(out) < n:
        raise ConfigError(f"{env}'s {split} split gave {len(out)} distinct tasks outside the training ones, fewer "
                          f"than the {n} needed; lower --examples or --eval-examples")
    return out[:n]


def environment(env: str) -> type:
    """The environment class ``env`` names; multi-role environments are refused, as ``reward.judge`` refuses them."""
    from ctxrl.envs.registry import configured_env_class
    from ctxrl.envs.roles import is_multi_role

    cls = configured_env_class(env)
    if is_multi_role(cls):
        raise ConfigError(f"{env} plays several roles ({', '.join(cls.roles)}); reward.judge grades one-seat "
                          "environments only, so there is no judge to tune for it")
    return cls


# -- the rubric's verdicts --------------------------------------------------------------------------------------
def verdict_words(rubric, path: str) -> tuple[str, str]:
    """The words a tuned judge writes for yes and for no: the rubric's highest and lowest ``[labels]``, capitalised
    (``Yes``, ``No``), each checked to parse as its label and to pass (score >= 0.5) or fail."""
    if not rubric.labels:
        raise ConfigError(f"the rubric {path or '(default)'} has no [labels]: judge_tune trains a one-word verdict. "
                          "Give it one criterion, scale = [0, 1] and [labels] yes = 1, no = 0 "
                          "(examples/rubrics/answer_matches_reference.toml)")
    ranked = sorted(rubric.labels, key=rubric.labels.get)
    reject, accept = ranked[0], ranked[-1]
    name = rubric.items[0].name
    passes = {w: rubric.combine({name: rubric.labels[w]}) >= 0.5 for w in (accept, reject)}
    if not passes[accept] or passes[reject]:
        raise ConfigError(f"the rubric {path}'s labels {rubric.labels} on the scale [{rubric.low:g}, {rubric.high:g}] "
                          "need one that passes (in the top half of the scale) and one that fails (bottom half)")
    words = accept.capitalize(), reject.capitalize()
    for word, label in zip(words, (accept, reject)):
        if rubric.parse(word) != {name: rubric.labels[label]}:  # (the verdict parser decides what a run reads)
            raise ConfigError(f"the rubric {path} does not read the reply {word!r} as {label}")
    return words


# -- what the judge is shown ------------------------------------------------------------------------------------
def episode_of(example: JudgeExample) -> Episode:
    """An episode ending in the example's final message (all that ``reward.judge.input=answer`` reads of it)."""
    return Episode(task=example.task, messages=[Message("user", example.task.prompt),
                                                Message("assistant", example.answer)])


def render(judge, example: JudgeExample, words: tuple[str, str]) -> tuple[list[int], list[int]]:
    """The ids of the judge's prompt for ``example`` (``Judge.question`` through its backend's renderer) and of
    the completion it should give: the verdict word and the end-of-turn token."""
    messages, _ = judge.question(episode_of(example))
    renderer = judge.backend.renderer
    return renderer.prompt_ids(messages, None), renderer.assistant_ids(words[0] if example.label else words[1])


# -- fine-tuning ------------------------------------------------------------------------------------------------
def pad(rows: list[tuple[list[int], list[int]]], pad_token_id: int):
    """Right-padded ``input_ids`` and ``attention_mask`` [B, T] of prompt + completion, and the ``loss_mask``
    [B, T-1] of the positions whose next token is a completion token (1) rather than prompt or padding (0)."""
    import torch

    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    token_mask = torch.zeros((len(rows), width))
    for row, (prompt, completion) in enumerate(rows):
        ids = prompt + completion
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention_mask[row, :len(ids)] = 1
        token_mask[row, len(prompt):len(ids)] = 1  # born with the tokens: the completion's, never the prompt's
    return input_ids, attention_mask, token_mask[:, 1:]


def completion_loss(model, input_ids, attention_mask, loss_mask, *, chunk: int = 1024):
    """``-sum(loss_mask * log p(ids[t+1] | ids[:t+1])) / sum(loss_mask)``: the completion tokens' mean negative
    log-likelihood. ``input_ids``, ``attention_mask`` [B, T]; ``loss_mask`` [B, T-1]."""
    from ctxrl.learner.logprobs import token_logprobs

    logprobs = token_logprobs(model, input_ids, attention_mask, mask=loss_mask, chunk=chunk)
    return -(logprobs * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def fine_tune(model, rows: list[tuple[list[int], list[int]]], *, pad_token_id: int, steps: int, batch_size: int,
              lr: float, dtype: str, seed: int, on_step=None) -> list[float]:
    """``steps`` AdamW steps on ``batch_size`` rows each (the rows in a seeded order, reshuffled every pass);
    returns each step's loss. Warm-up over 5% of the steps, then cosine decay to 0; gradients clipped at 1."""
    import torch

    from ctxrl.learner.precision import Precision, trainable_grads
    from ctxrl.models.kernels import attention_kernels

    device = next(model.parameters()).device
    precision = Precision(dtype, "float32", str(device))
    optimizer = precision.optimizer(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1.0 + math.cos(math.pi * max(0, s - warmup) / max(1, steps - warmup))))
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    losses: list[float] = []
    model.train()
    for step in range(steps):
        while len(order) < batch_size:
            order += torch.randperm(len(rows), generator=generator).tolist()
        batch, order = [rows[i] for i in order[:batch_size]], order[batch_size:]
        input_ids, attention_mask, loss_mask = (t.to(device) for t in pad(batch, pad_token_id))
        optimizer.zero_grad(set_to_none=True)
        with attention_kernels(device):
            loss = completion_loss(model, input_ids, attention_mask, loss_mask)
            precision.backward(loss)
        precision.unscale(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(trainable_grads(optimizer), 1.0)
        if torch.isfinite(norm):
            precision.step(optimizer)
        precision.update()
        scheduler.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, steps, losses[-1])
    if hasattr(optimizer, "close"):  # a MasterAdamW's gradient hooks
        optimizer.close()
    model.eval()
    return losses


# -- evaluation -------------------------------------------------------------------------------------------------
def evaluate(judge, examples: list[JudgeExample]) -> dict:
    """The judge's first reply to each example, as ``Judge`` asks first (greedy, ``spec.max_tokens``, seed 0), all
    at once (the engine batches them). A verdict passes with a score >= 0.5; no verdict counts as wrong."""
    from ctxrl.judge.rubric import JudgeParseError

    async def ask(example: JudgeExample) -> str:
        messages, _ = judge.question(episode_of(example))
        return await judge.backend.complete(messages, judge.spec.max_tokens, temperature=0.0, seed=0)

    async def ask_all() -> list[str]:
        return list(await asyncio.gather(*(ask(e) for e in examples)))

    started = time.perf_counter()
    replies = asyncio.run(ask_all())
    passed: list[bool | None] = []
    for reply in replies:
        try:
            passed.append(judge.rubric.combine(judge.rubric.parse(reply)) >= 0.5)
        except JudgeParseError:
            passed.append(None)

    def rate(values: list[bool]) -> float | None:
        return sum(values) / len(values) if values else None

    pairs = list(zip(examples, passed))
    kinds = sorted({e.kind for e in examples if not e.label})
    return {
        "examples": len(examples),
        "accuracy": rate([p is not None and p == e.label for e, p in pairs]),
        "no_verdict": rate([p is None for p in passed]),
        "yes_rate_on_yes": rate([p is True for e, p in pairs if e.label]),
        "yes_rate_on_no": rate([p is True for e, p in pairs if not e.label]),
        "yes_rate_by_kind": {k: rate([p is True for e, p in pairs if e.kind == k]) for k in kinds},
        "seconds": time.perf_counter() - started,
        "samples": [{"kind": e.kind, "reference": e.task.answer, "answer": e.answer, "reply": r}
                    for e, r in list(zip(examples, replies))[:6]],
    }


def table(before: dict, after: dict | None) -> str:
    """Before and after, one row each: accuracy, no verdict, yes on yes, yes on no, then yes per wrong kind."""
    kinds = list(before["yes_rate_by_kind"])
    head = ["", "accuracy", "no_verdict", "yes|yes", "yes|no", *(f"yes|{k}" for k in kinds)]
    rows = [head]
    for name, r in [("before", before), ("after", after)]:
        if r is not None:
            values = [r["accuracy"], r["no_verdict"], r["yes_rate_on_yes"], r["yes_rate_on_no"],
                      *(r["yes_rate_by_kind"].get(k) for k in kinds)]
            rows.append([name, *("-" if v is None else f"{v:.2f}" for v in values)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


# -- the command ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from ctxrl.judge.spec import JudgeSettings
    from ctxrl.models.loader import DTYPES

    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Defaults after each option; the module docstring as it is written."""

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    parser.add_argument("--env", default="calculator", help="the environment whose tasks the judge grades")
    parser.add_argument("--rubric", default="examples/rubrics/answer_matches_reference.toml",
                        help="a rubric with one criterion and [labels] (reward.judge.rubric)")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="the model to tune: any model.name (a named model, tiny:..., a checkpoint directory)")
    parser.add_argument("--examples", type=int, default=2000, help="training examples, half yes and half no")
    parser.add_argument("--eval-examples", type=int, default=200,
                        help="held-out examples (tasks no training example has), before and after")
    parser.add_argument("--eval-split", default="train",
                        help="the split held-out tasks come from (train: the tasks a run's judge grades)")
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps (0: evaluate the model only)")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per step")
    parser.add_argument("--lr", type=float, default=5e-5, help="AdamW's peak learning rate")
    parser.add_argument("--max-tokens", type=int, default=JudgeSettings.max_tokens,
                        help="tokens per reply in evaluation (reward.judge.max_tokens)")
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the weights' dtype (bfloat16 trains float32 master weights)")
    parser.add_argument("--seed", type=int, default=0, help="tasks, wrong answers and batch order")
    parser.add_argument("--save", default="runs/judge",
                        help=f"the tuned judge's checkpoint directory, with the report as {MARKER} ('' or --steps 0: "
                             "nothing is saved)")
    parser.add_argument("--out", help="also write the report (JSON) here")
    args = parser.parse_args(argv)
    if args.examples < 2:
        parser.error(f"--examples {args.examples} is too small: at least 2 (one yes, one no) are needed")
    if args.steps and args.examples < args.batch_size:
        parser.error(f"--examples {args.examples} is smaller than --batch-size {args.batch_size}: every step would "
                     "repeat examples within its batch; raise --examples or lower --batch-size")
    if args.eval_examples < 2:
        parser.error(f"--eval-examples {args.eval_examples} is too small: at least 2 (one yes, one no) are needed")
    for name in ("steps", "max_tokens"):
        if getattr(args, name) < (0 if name == "steps" else 1):
            parser.error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'steps' else '>= 1'}")
    if args.batch_size < 1 or not args.lr > 0:
        parser.error("--batch-size must be >= 1 and --lr > 0")
    return args


def check_save(path: Path) -> None:
    """``--save`` is absent, empty, or a directory this script wrote before (it holds ``MARKER``)."""
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / MARKER).exists())):
        raise ConfigError(f"--save {path} exists and is not a judge this script saved (no {MARKER} in it); choose "
                          "a new directory")


def main(argv: list[str] | None = None) -> dict:
    """Build the examples, evaluate, fine-tune, save, evaluate the saved judge; returns the report."""
    args = parse_args(argv)
    from ctxrl.judge.judge import Judge
    from ctxrl.judge.rubric import load_rubric
    from ctxrl.judge.spec import NO_CACHE, JudgeSettings
    from ctxrl.learner.precision import Precision
    from ctxrl.models.loader import resolve_device
    from ctxrl.train.tiny import ensure_model

    try:
        rubric = load_rubric(args.rubric)
    except ValueError as exc:
        raise ConfigError(f"--rubric: {exc}") from None
    words = verdict_words(rubric, args.rubric)
    env_cls = environment(args.env)
    save = Path(args.save) if args.save and args.steps else None
    if save is not None:
        check_save(save)
    train_tasks = draw_tasks(env_cls, args.env, "train", math.ceil(args.examples / 2), args.seed)
    heldout_tasks = draw_tasks(env_cls, args.env, args.eval_split, math.ceil(args.eval_examples / 2), args.seed + 1,
                               avoid={t.prompt for t in train_tasks})
    train_examples = make_examples(env_cls, train_tasks, args.examples, args.seed)
    heldout = make_examples(env_cls, heldout_tasks, args.eval_examples, args.seed + 1)

    device = resolve_device(args.device)
    Precision(args.dtype, "float32", device)  # (refuses float16 off CUDA before anything loads)
    ensure_model(args.model)
    spec = JudgeSettings(target=args.model, rubric=args.rubric, input="answer", reference=True,
                         max_tokens=args.max_tokens, cache=NO_CACHE)
    judge = Judge.from_spec(spec, device=device, dtype=args.dtype)
    print(f"{args.model} as the judge of {args.env} ({args.rubric}) on {device} in {args.dtype}: "
          f"{len(train_examples)} training and {len(heldout)} held-out examples, half {words[0]}, half {words[1]}",
          flush=True)
    report = {"env": args.env, "rubric": args.rubric, "model": args.model, "words": list(words),
              "settings": vars(args), "before": evaluate(judge, heldout), "after": None}
    if args.steps:
        report["train"] = train(judge, [render(judge, e, words) for e in train_examples], args)
        if save is not None:
            save_judge(judge, save)
            judge.backend.engine.close()
            judge = Judge.from_spec(dataclasses.replace(spec, target=str(save)), device=device,
                                    dtype=args.dtype)  # what reward.judge.target=SAVE loads
        report["after"] = evaluate(judge, heldout)
    report["use"] = (f"reward.judge.target={save or '<the tuned model>'} reward.judge.rubric={args.rubric} "
                     f"reward.judge.input=answer reward.judge.reference=true reward.judge.max_tokens={args.max_tokens}")
    print(table(report["before"], report["after"]))
    text = json.dumps(report, indent=1)
    if save is not None:
        (save / MARKER).write_text(text)
        print(f"saved the judge in {save}; a run uses it with {report['use']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return report


def train(judge, rows: list[tuple[list[int], list[int]]], args: argparse.Namespace) -> dict:
    """Fine-tune the judge's model in place on ``rows`` (``fine_tune``), printing the loss ten times; the figures."""
    engine, tokenizer = judge.backend.engine, judge.backend.renderer.tokenizer
    longest = max(len(p) + len(c) for p, c in rows)
    if longest > engine.max_total_tokens:
        raise ConfigError(f"a training example is {longest} tokens, more than {args.model}'s context "
                          f"({engine.max_total_tokens}); use a model with a longer context")
    every = max(1, args.steps // 10)

    def report(step: int, total: int, loss: float) -> None:
        if step % every == 0 or step == total:
            print(f"step {step}/{total}: loss {loss:.4f}", flush=True)

    started = time.perf_counter()
    losses = fine_tune(engine.model, rows, pad_token_id=tokenizer.pad_token_id, steps=args.steps,
                       batch_size=args.batch_size, lr=args.lr, dtype=args.dtype, seed=args.seed, on_step=report)
    return {"examples": len(rows), "longest_tokens": longest, "losses": losses,
            "seconds": time.perf_counter() - started}


def save_judge(judge, save: Path) -> None:
    """The judge's model, tokenizer and chat template as a checkpoint directory, written beside ``save`` and then
    moved into place (replacing a judge this script saved there before)."""
    from ctxrl.run.checkpoint import save_pretrained

    partial = save.with_name(save.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    save_pretrained(judge.backend.engine.model, judge.backend.renderer.tokenizer, partial)
    (partial / MARKER).write_text("{}")  # (the report replaces it once the saved judge is evaluated)
    if save.exists():
        shutil.rmtree(save)  # (check_save: a judge this script saved)
    partial.rename(save)


if __name__ == "__main__":
    try:
        main()
    except CtxrlError as exc:
        print(f"judge_tune: {exc.kind}: {exc}", file=sys.stderr)
        sys.exit(2)
