"""The meta loop: a trial of up to K attempts at one task, with feedback and reflections in between.

One trial is one ``Episode`` whose sequences (``Episode.sequences()``) are its attempts, in order:
sequence ``k`` is attempt ``k``. Each attempt is an ordinary episode of the agent loop
(``run_episode``) on a freshly built and reset environment (same task, same reset seed, so the
same instance of it), starting from its own opening:

- attempt 0: the environment's opening, exactly as a single episode's (so "attempt 1" of a trial
  is a sample of the zero-context policy);
- attempt ``k >= 1``, ``carry="reflections"``: the system message and the task, with a note per
  earlier attempt appended to the task (its feedback line and, if ``reflect``, the reflection
  written after it), then ``This is attempt k+1 of K.``;
- attempt ``k >= 1``, ``carry="attempts"``: the system message, the task, then every earlier
  attempt in full as conversation (its turns, the observations that ended it, the feedback, the
  reflection if any), then ``This is attempt k+1 of K.`` as a user message.

The carried history is kept within a budget: the oldest attempts' notes (or whole attempts) are
dropped until the opening leaves room for a turn (``rollout.max_total_tokens``) and fits
``max_context_tokens`` (0: no budget of its own). Every opening is rendered as a fresh prompt, so
each sequence's prompt is exactly its messages (loss mask 0), like a ``summarize`` segment's.

After attempt ``k``, if the trial goes on (``k < K-1``, and not ``stop_on_success`` after a
success) and ``reflect`` is on, the attempt's sequence continues with the observations that ended
it and one user message, the feedback line and the reflection instruction (mask 0), and the policy
samples a reflection (mask 1, behaviour log-probs kept: trained). Where the reflection's sampled
tokens start is recorded (``info["attempts"][k]["reflection_start"]``), so the trainer can give
them their own advantage (``ctxrl.algo.credit.reflection_advantages``). No reflection is sampled
after the last attempt played: it would condition nothing. ``reflect=False`` carries only the
feedback lines (plain retries; with ``carry="attempts"``, the in-context RL baseline: previous
attempts and their rewards in context).

The feedback is generic: ``Attempt k of K solved the task`` / ``did not solve the task``, with the
attempt's reward; the environment's own last observations (a ``BOOM``, a final board) come before
it. An attempt that errors makes the whole trial errored (``truncation="error"``); a trial never
stops early on a failure. ``limits.timeout_s`` (``rollout.episode_timeout_s``) is the deadline of each
attempt (its reset, turns and tools) and, separately, of each reflection. Context managers inside an
attempt are not supported (``full`` only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Engine
from ctxrl.envs.hooks import flag
from ctxrl.envs.recorded import RecordedEnv
from ctxrl.envs.tool_answer import parse_answer
from ctxrl.meta.demos import Demo, with_demos
from ctxrl.prompts import NOTES_HEADER
from ctxrl.rollout.agent import EnvironmentFailure, notify, record_error, reset_env, run_episode
from ctxrl.rollout.generate import sample_aside
from ctxrl.rollout.messages import task_with, text_only
from ctxrl.rollout.recorder import Recorder, join
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.sections import MetaConfig
from ctxrl.seeds import ATTEMPT_SALT, REFLECTION_SALT, derive_seed, episode_seed
from ctxrl.types import Episode, Message, Task

CARRIES = ("reflections", "attempts")
"""What an attempt carries of the earlier ones (``meta.carry``): their reflections, or the attempts in full."""


def check_trial(policy: MetaConfig) -> None:
    """A ``ValueError`` for a ``[meta]`` section no trial can be played with (a ``MetaConfig`` built in Python; a
    loaded config is checked by ``ctxrl.run.validate``)."""
    if policy.num_attempts < 1:
        raise ValueError(f"num_attempts must be >= 1, got {policy.num_attempts}")
    if policy.carry not in CARRIES:
        raise ValueError(f"carry must be one of {', '.join(CARRIES)}, not {policy.carry!r}")
    if policy.reflection_max_tokens < 1:
        raise ValueError(f"reflection_max_tokens must be >= 1, got {policy.reflection_max_tokens}")


def feedback_text(k: int, num_attempts: int, reward: float, success: bool) -> str:
    """The feedback line on attempt ``k`` (0-based; shown 1-based)."""
    outcome = "solved the task" if success else "did not solve the task"
    return f"Attempt {k + 1} of {num_attempts} {outcome} (reward {reward:g})."


def attempt_header(k: int, num_attempts: int) -> str:
    return f"This is attempt {k + 1} of {num_attempts}."


@dataclass
class Carried:
    """What one finished attempt leaves for the next ones."""

    index: int
    """Which attempt of the trial it was (0-based)."""
    conversation: list[Message]
    """The attempt after its opening: its turns and the observations that ended it."""
    feedback: str
    reflection: str | None = None


def reflections_opening(base: list[Message], carried: list[Carried], k: int, num_attempts: int) -> list[Message]:
    """System + task with one note per carried attempt and the attempt header appended (``base`` for k = 0)."""
    if k == 0:
        return list(base)
    notes = [c.feedback + (f" Your reflection: {c.reflection.strip()}" if c.reflection is not None else "")
             for c in carried]
    return task_with(base, NOTES_HEADER, "\n".join([*notes, attempt_header(k, num_attempts)]))


def attempts_opening(base: list[Message], carried: list[Carried], k: int, num_attempts: int,
                     instruction: str) -> list[Message]:
    """System + task, then each carried attempt in full (its header from attempt 2 on, its turns, feedback and
    reflection), then attempt ``k``'s header: the conversation the trial has been, as one chat."""
    if k == 0:
        return list(base)
    system = [m for m in base if m.role == "system"][:1]
    task = next(m for m in base if m.role == "user")
    out = [*system, task]
    for c in carried:
        if c.index > 0:
            out.append(Message("user", attempt_header(c.index, num_attempts)))
        out += [text_only(m) for m in c.conversation]  # from text alone, as the window manager shows turns
        if c.reflection is not None:
            out += [Message("user", f"{c.feedback}\n{instruction}"), Message("assistant", c.reflection)]
        else:
            out.append(Message("user", c.feedback))
    out.append(Message("user", attempt_header(k, num_attempts)))
    return out


def attempt_actions(messages: list[Message]) -> list[str]:
    """Canonical strings of an attempt's actions: ``name({json args})`` per tool call, ``answer(text)`` per answer."""
    out = []
    for m in messages:
        if m.role != "assistant":
            continue
        for call in m.tool_calls:
            out.append(f"{call.name}({json.dumps(call.arguments, sort_keys=True)})")
        if not m.tool_calls:
            answer = parse_answer(m.content)
            if answer is not None:
                out.append(f"answer({answer})")
    return out


async def run_trial(make_env: Callable[[], Any], task: Task, engine: Engine, renderer: ChatRenderer,
                    limits: RolloutLimits, policy: MetaConfig, *, seed: int, group_id: int = 0,
                    demos: list[Demo] | None = None) -> Episode:
    """Play one trial of ``task`` (up to ``policy.num_attempts`` attempts: the phase's, ``RolloutRequest.meta``);
    always returns an ``Episode`` (sequences = attempts, see module docstring)."""
    check_trial(policy)
    started = time.perf_counter()
    attempts: list[Episode] = []
    records: list[dict[str, Any]] = []
    carried: list[Carried] = []
    failure: tuple[int, BaseException | Episode, float] | None = None  # (attempt, cause, seconds it took)
    num_attempts = policy.num_attempts
    for k in range(num_attempts):
        t0 = time.perf_counter()
        try:
            env, base = await _fresh_env(make_env, task, seed, limits, demos or [])
        except (EnvironmentFailure, TimeoutError, asyncio.TimeoutError) as exc:
            failure = (k, exc, time.perf_counter() - t0)
            break
        tools = [t.schema() for t in env.tools] or None
        opening, kept, opening_tokens = _fitted_opening(base, carried, k, policy, renderer, tools, limits)
        episode = await run_episode(env, task, engine, renderer, limits,
                                    seed=seed if k == 0 else derive_seed(seed, ATTEMPT_SALT + k), group_id=group_id,
                                    opening=opening, spent_s=time.perf_counter() - t0)
        attempts.append(episode)
        record = {"reward": episode.reward, "success": episode.success, "truncation": episode.truncation,
                  "turns": len(episode.turns), "tool_calls": episode.tool_calls, "tool_errors": episode.tool_errors,
                  "sampled_tokens": sum(episode.loss_mask), **_actions(env, episode, len(opening)),
                  "opening_tokens": opening_tokens, "carried": kept, "dropped": len(carried) - kept,
                  "feedback": None, "reflection": None, "reflection_start": None, "reflection_tokens": 0,
                  "reflection_skipped": False}
        records.append(record)
        if episode.truncation == "error":
            failure = (k, episode, 0.0)
            break
        if k == num_attempts - 1 or (episode.success and policy.stop_on_success):
            break
        conversation = [*episode.messages[len(opening):], *env.unseen(episode)]
        record["feedback"] = feedback_text(k, num_attempts, episode.reward, episode.success)
        if policy.reflect:
            t0 = time.perf_counter()
            try:
                reflect = _reflect(episode, env.unseen(episode), record, tools, engine, renderer, limits, policy,
                                   seed, k)
                if limits.timeout_s > 0:
                    await asyncio.wait_for(reflect, limits.timeout_s)
                else:
                    await reflect
            except (TimeoutError, asyncio.TimeoutError) as exc:  # the deadline: the trial is errored
                failure = (k, exc, time.perf_counter() - t0)
                break
        carried.append(Carried(k, conversation, record["feedback"], record["reflection"]))
    return _trial_episode(task, group_id, engine, num_attempts, attempts, records, failure, limits,
                          time.perf_counter() - started, len(demos or []))


async def _fresh_env(make_env: Callable[[], Any], task: Task, seed: int, limits: RolloutLimits,
                     demos: list[Demo]) -> tuple[RecordedEnv, list[Message]]:
    """A newly built and reset environment for one attempt, and its opening with ``demos`` written in.

    An environment that fails (its constructor, its reset, the deadline) is closed and its failure
    raised: ``EnvironmentFailure``, ``TimeoutError`` or ``asyncio.TimeoutError`` (the trial is errored).
    """
    env = None
    try:
        try:
            env = RecordedEnv(make_env())
        except Exception as exc:  # noqa: BLE001 - the environment's failure: an errored trial
            raise EnvironmentFailure("constructor", exc) from exc
        return env, with_demos(await reset_env(env, task, seed, limits.timeout_s), demos)
    except (EnvironmentFailure, TimeoutError, asyncio.TimeoutError):
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - the trial is errored already
                pass
        raise


def _actions(env: RecordedEnv, episode: Episode, opening: int) -> dict[str, list[str] | None]:
    """An attempt's ``actions`` and ``failed_actions``: the environment's own where it names them
    (``names_actions``, see ``ctxrl.envs.tool_answer``), else its tool calls and answers (``attempt_actions``;
    ``failed_actions`` None: judged by the attempt's outcome)."""
    if flag(env.env, "names_actions"):
        return {"actions": list(episode.info.get("actions", [])),
                "failed_actions": list(episode.info.get("failed_actions", []))}
    return {"actions": attempt_actions(episode.messages[opening:]), "failed_actions": None}


def _fitted_opening(base, carried, k, policy: MetaConfig, renderer, tools,
                    limits) -> tuple[list[Message], int, int]:
    """Attempt ``k``'s opening with as many of the newest carried attempts as fit: (messages, how many, tokens)."""
    def build(kept: list[Carried]) -> list[Message]:
        if policy.carry == "reflections":
            return reflections_opening(base, kept, k, policy.num_attempts)
        return attempts_opening(base, kept, k, policy.num_attempts, policy.reflection_instruction)

    for start in range(len(carried) + 1):
        messages = build(carried[start:])
        n = len(renderer.prompt_ids(messages, tools))
        if n + limits.max_new_tokens <= limits.max_total_tokens and (
                policy.max_context_tokens <= 0 or n <= policy.max_context_tokens):
            return messages, len(carried) - start, n
    bare = build([])  # nothing carried fits: the bare task (the agent loop ends it if even that cannot fit)
    return bare, 0, len(renderer.prompt_ids(bare, tools))


async def _reflect(episode: Episode, observations: list[Message], record: dict[str, Any], tools, engine: Engine,
                   renderer: ChatRenderer, limits: RolloutLimits, policy: MetaConfig, seed: int, k: int) -> None:
    """Append the last observations, feedback and instruction (mask 0), then sample a reflection (mask 1)."""
    if not episode.turns or episode.messages[-1].role != "assistant":
        record["reflection_skipped"] = True  # no turn was played (the opening left no room): nothing to reflect on
        return
    ask = [*observations, Message("user", f"{record['feedback']}\n{policy.reflection_instruction}")]
    turn = len(episode.turns)  # the reflection is the generation after the attempt's last turn
    aside = await sample_aside(Recorder(episode, renderer, tools), ask, engine, limits,
                               max_new_tokens=policy.reflection_max_tokens, seed=seed, counter=REFLECTION_SALT + k,
                               purpose="reflection", turn=turn, ask_turn=turn - 1,
                               closed=episode.turns[-1].finish_reason == "stop")
    if aside is None:
        record["reflection_skipped"] = True  # no room left in this sequence: the next attempt carries the feedback
        return
    record["reflection_start"], record["reflection_tokens"] = aside.start, aside.tokens
    record["reflection"], record["reflection_truncated"] = aside.text, aside.truncated


def _trial_episode(task: Task, group_id: int, engine: Engine, num_attempts: int, attempts: list[Episode],
                   records: list[dict[str, Any]], failure, limits: RolloutLimits, seconds: float,
                   demos: int) -> Episode:
    """One Episode for the trial: attempts 0..n-2 as closed segments, the last one live.

    An attempt that a history-rewriting chat template cut into segments (``ctxrl.chat.render``)
    brings all of them, in order; ``records[k]["segments"]`` says how many, and its reflection
    (``reflection_start``) is in the last.
    """
    trial = Episode(task=task, group_id=group_id, policy_version=engine.policy_version)
    ends = ["reflection" if r["reflection_start"] is not None else "attempt" for r in records[:len(attempts) - 1]]
    segments = []
    for a, end, record in zip(attempts, [*ends, "end"], records):
        *earlier, live = a.sequences()
        record["segments"] = len(earlier) + 1
        segments += [*earlier, dataclasses.replace(live, ended_by=end)]
    join(trial, segments)
    if attempts:
        trial.truncation = attempts[-1].truncation
    trial.turns = [t for a in attempts for t in a.turns]
    trial.reward = sum(a.reward for a in attempts)
    trial.success = any(a.success for a in attempts)
    trial.info.update({"attempts": records, "num_attempts": num_attempts, "seconds": seconds, "demos": demos,
                       "reflections": sum(r["reflection_start"] is not None for r in records),
                       "reflections_skipped": sum(r["reflection_skipped"] for r in records),
                       "reflection_tokens": sum(r["reflection_tokens"] for r in records)})
    if failure is not None:
        k, cause, elapsed = failure
        trial.truncation = "error"
        trial.info["error_attempt"] = k
        if isinstance(cause, Episode):
            trial.info["error"], trial.info["error_kind"] = cause.info.get("error"), cause.info.get("error_kind")
        else:
            record_error(trial, cause, limits, elapsed)
    return trial


async def run_trials(make_env: Callable[[], Any], tasks: list[Task], engine: Engine, renderer: ChatRenderer,
                     limits: RolloutLimits, policy: MetaConfig, *, group_size: int = 1, seed: int = 0,
                     demos: Callable[[int, int], list[Demo]] | None = None,
                     on_done: Callable[[Episode], None] | None = None, first_group: int = 0) -> list[Episode]:
    """Play ``group_size`` trials per task concurrently; trial ``k`` of task ``i`` has group ``first_group + i``
    (the group statistics of the credit are over trials). Seeds as ``run_episodes``'s, so attempt 0 of a
    trial samples what the single episode with the same seed would. ``demos`` as in ``run_episodes``."""
    jobs = []
    for group_id, task in enumerate(tasks, start=first_group):
        for k in range(group_size):
            chosen = demos(group_id, k) if demos is not None else []
            jobs.append(run_trial(make_env, task, engine, renderer, limits, policy,
                                  seed=episode_seed(seed, group_id, k), group_id=group_id, demos=chosen))
    return list(await asyncio.gather(*(notify(job, on_done) for job in jobs)))
