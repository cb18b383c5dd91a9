"""The agent loop: one token-faithful episode, and many of them at once.

Per turn: the engine samples an assistant turn from the current ids; those ids go into the
episode with loss mask 1 and their behaviour log-probs; the text is parsed for tool calls and
handed to ``env.step``; the environment's reply is rendered *alone* and appended with loss
mask 0. The loss mask is therefore decided where tokens are born and never rebuilt from text.

Limits end an episode and are recorded in ``Episode.truncation``: ``max_turns``,
``max_new_tokens`` (a turn was cut off before its end-of-turn token), ``max_total_tokens``. An
exception from the environment or engine ends that episode with truncation ``error`` (the
message is kept in ``info["error"]``, ``info["error_kind"]`` is ``exception``); so does running
past ``RolloutLimits.timeout_s``, the episode's wall-clock deadline (``error_kind`` ``deadline``),
which covers the environment's set-up (``reset`` then runs in a worker thread), model time and
tool time. The other episodes go on. ``run_episodes`` resets every environment before the first
generation, so how long each reset took never changes which episodes share an engine batch.

A seeded episode seeds each turn's sampling (``derive_seed(seed, turn)``), so it samples the
same tokens however the engine happens to batch it with other episodes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ctxrl.chat.render import ChatRenderer
from ctxrl.chat.toolcalls import parse_assistant
from ctxrl.engine.base import Engine, SamplingParams
from ctxrl.engine.sampling import derive_seed
from ctxrl.rollout.context import FOLD_TOOL_SCHEMAS, ContextPolicy, branch_messages, restart_messages, window_messages
from ctxrl.rollout.demos import Demo, with_demos
from ctxrl.types import Episode, Message, Segment, Task, Turn

SUMMARY_SEED_OFFSET = 1_000_000  # summary k samples with derive_seed(seed, SUMMARY_SEED_OFFSET + k)


@dataclass(frozen=True)
class RolloutLimits:
    """Sampling settings and the limits of one episode."""

    max_turns: int = 4
    max_new_tokens: int = 64
    max_total_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    timeout_s: float = 0.0
    """Wall-clock deadline of the whole episode (set-up, model and tool time); 0 = none."""
    context: ContextPolicy = ContextPolicy()
    """The context manager (``full``, or ``summarize`` with its budget and summary limit)."""


async def run_episode(env: Any, task: Task, engine: Engine, renderer: ChatRenderer, limits: RolloutLimits,
                      *, seed: int | None = None, group_id: int = 0, opening: list | None = None,
                      spent_s: float = 0.0) -> Episode:
    """Play one episode of ``env`` on ``task`` with ``engine``; always returns an ``Episode``.

    ``opening``: the messages ``env.reset`` already returned (``run_episodes`` resets every
    environment before any generation, so that reset times never decide the engine's batches);
    ``spent_s`` is the deadline time that reset used.
    """
    episode = Episode(task=task, group_id=group_id, policy_version=getattr(engine, "version", 0))
    started = time.perf_counter() - spent_s

    async def body() -> None:
        messages = opening if opening is not None else await reset_env(env, task, seed, limits.timeout_s)
        await _play(env, task, engine, renderer, limits, seed, episode, messages)

    try:
        if limits.timeout_s > 0:
            await asyncio.wait_for(body(), max(limits.timeout_s - spent_s, 1e-3))
        else:
            await body()
    except (TimeoutError, asyncio.TimeoutError) as exc:
        record_error(episode, exc, limits, time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 - an errored episode is data, not a crash
        record_error(episode, exc, limits, time.perf_counter() - started)
    finally:
        try:
            env.close()
        except Exception as exc:  # noqa: BLE001 - a failing close must not lose the episode
            episode.info["close_error"] = f"{type(exc).__name__}: {exc}"
    episode.info["seconds"] = time.perf_counter() - started
    return episode


def record_error(episode: Episode, exc: BaseException, limits: RolloutLimits, elapsed: float) -> None:
    episode.truncation = "error"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) and limits.timeout_s > 0 and elapsed >= limits.timeout_s:
        episode.info["error"] = (f"deadline: the episode ran past rollout.episode_timeout_s={limits.timeout_s:g} s "
                                 f"(in turn {len(episode.turns)})")
        episode.info["error_kind"] = "deadline"
    else:
        episode.info["error"] = f"{type(exc).__name__}: {exc}"
        episode.info["error_kind"] = "exception"


async def reset_env(env: Any, task: Task, seed: int | None, timeout_s: float) -> list:
    """``env.reset(task, seed=seed)``; with a deadline, in a daemon thread so a hung set-up is abandoned.

    A daemon thread (not the event loop's executor): ``asyncio.run`` waits for its executor's
    threads at exit, and an abandoned reset must never hold up the step or the process.
    """
    if timeout_s <= 0:
        return env.reset(task, seed=seed)
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def target() -> None:
        try:
            result, error = env.reset(task, seed=seed), None
        except BaseException as exc:  # noqa: BLE001 - handed to the episode
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop is gone: the episode was abandoned long ago
            pass

    threading.Thread(target=target, name="ctxrl-env-reset", daemon=True).start()
    return await asyncio.wait_for(future, timeout_s)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _play(env, task, engine, renderer, limits, seed, episode: Episode, messages) -> None:
    fold = _Fold(episode, limits.context) if limits.context.manager == "fold" else None
    try:
        await _turns(env, engine, renderer, limits, seed, episode, messages, fold)
    finally:
        if fold is not None:
            fold.finish()  # a branch still open at the end is closed, and the parent is the live sequence


async def _turns(env, engine, renderer, limits, seed, episode: Episode, messages, fold) -> None:
    tools = [tool.schema() for tool in env.tools] or None
    if fold is not None:
        tools = [*(tools or []), *FOLD_TOOL_SCHEMAS]
    opening = list(messages)
    episode.messages = list(messages)
    episode.append(renderer.prompt_ids(messages, tools), sampled=False, turn=-1)
    if limits.context.over_budget(len(episode.input_ids), limits.max_new_tokens):
        episode.truncation = "max_context"  # the task alone leaves no room for a turn in the budget
        return
    for turn in range(limits.max_turns):
        room = limits.max_total_tokens - len(episode.input_ids)
        if room <= 0:
            episode.truncation = "max_total_tokens"
            return
        params = sampling_params(limits, renderer, min(limits.max_new_tokens, room), seed, turn)
        prompt_tokens = len(episode.input_ids)
        completion = await engine.generate(list(episode.input_ids), params)
        episode.append(completion.token_ids, sampled=True, turn=turn, logprobs=completion.logprobs)
        closed = completion.finish_reason == "stop"
        text = renderer.decode(completion.token_ids[:-1] if closed else completion.token_ids)
        message = parse_assistant(text)
        episode.messages.append(message)
        record = Turn(index=turn, prompt_tokens=prompt_tokens, sampled_tokens=len(completion.token_ids),
                      finish_reason=completion.finish_reason, text=text)
        episode.turns.append(record)
        if not closed:
            hit_total = len(episode.input_ids) >= limits.max_total_tokens
            episode.truncation = "max_total_tokens" if hit_total else "max_new_tokens"
            return
        if fold is not None:
            handled = fold.handle(message, opening, tools, renderer, turn, last=turn == limits.max_turns - 1,
                                  max_total_tokens=limits.max_total_tokens)
            if handled is not None:  # a branch opened or returned, or a misuse answered with an error
                record.tool_calls, record.tool_errors = 1, int(handled)
                if episode.truncation is not None:
                    return
                if turn == limits.max_turns - 1:
                    episode.truncation = "max_turns"
                    return
                continue
        result = await env.step(message)
        record.reward = float(result.reward)
        record.tool_calls = int(result.info.get("tool_calls", 0))
        record.tool_errors = int(result.info.get("tool_errors", 0))
        record.malformed_calls = int(result.info.get("malformed_tool_calls", 0))
        if "answered" in result.info:
            record.answered = bool(result.info["answered"])
        episode.reward += float(result.reward)
        for key in ("actions", "failed_actions"):  # an environment's own names for what it did (see ToolAnswerEnv)
            if key in result.info:
                episode.info.setdefault(key, []).extend(result.info[key])
        if "success" in result.info:
            episode.success = bool(result.info["success"])
        elif "correct" in result.info:
            episode.success = bool(result.info["correct"])
        if result.terminated:
            return
        if result.truncated:
            episode.truncation = "env"
            return
        if turn == limits.max_turns - 1:
            episode.truncation = "max_turns"
            return
        delta = renderer.continuation_ids(episode.messages, result.messages, tools)
        if limits.context.over_budget(len(episode.input_ids) + len(delta), limits.max_new_tokens):
            if limits.context.manager == "window":
                if not _window(episode, result.messages, tools, renderer, limits):
                    return
            elif not await _summarize(episode, result.messages, opening, tools, engine, renderer, limits, seed, turn):
                return
            continue
        if len(episode.input_ids) + len(delta) >= limits.max_total_tokens:
            episode.truncation = "max_total_tokens"
            return
        episode.append(delta, sampled=False, turn=turn)
        episode.messages.extend(result.messages)


class _Fold:
    """The ``fold`` manager's state: at most one open branch, and the parent sequence it paused."""

    def __init__(self, episode: Episode, policy: ContextPolicy) -> None:
        self.episode, self.policy = episode, policy
        self.parent: tuple | None = None  # (input_ids, loss_mask, behavior_logprobs, turn_index, messages)

    def handle(self, message: Message, opening: list, tools, renderer, turn: int, *, last: bool,
               max_total_tokens: int) -> bool | None:
        """Act on a branch / return call: None = not ours (the environment steps); else whether it was an error.

        On the last turn nothing is appended (no generation would see it) and no branch opens; an
        observation that would pass ``max_total_tokens`` ends the episode there instead.
        """
        self.last, self.max_total_tokens = last, max_total_tokens
        names = [c.name for c in message.tool_calls]
        mine = [c for c in message.tool_calls if c.name in ("branch", "return")]
        if not mine:
            if self.parent is not None and not message.tool_calls and not message.tool_call_errors:
                self._return(message.content, renderer, tools, turn)  # a plain reply ends the branch as its result
                return False
            return None
        e = self.episode
        error = None
        if len(names) > 1 or message.tool_call_errors:
            error = "branch and return must be the only call of their turn"
        elif mine[0].name == "branch" and self.parent is not None:
            error = "a branch cannot open another branch: finish this one with return(result)"
        elif mine[0].name == "return" and self.parent is None:
            error = "return is only for ending a branch; answer the main task directly"
        elif mine[0].name == "branch" and e.info.get("branches", 0) >= self.policy.max_branches:
            error = f"no branches left (at most {self.policy.max_branches} per episode)"
        elif mine[0].name == "branch" and last:
            error = "no turns left for a branch"
        key = "goal" if mine[0].name == "branch" else "result"
        value = mine[0].arguments.get(key)
        if error is None and not isinstance(value, str):
            error = f"{mine[0].name} needs a string argument {key!r}"
        if error is not None:
            self._observe(Message(role="tool", content=f"Error: {error}", name=mine[0].name), renderer, tools, turn)
            return True
        if mine[0].name == "return":
            self._return(value, renderer, tools, turn)
            return False
        self.parent = (e.input_ids, e.loss_mask, e.behavior_logprobs, e.turn_index, e.messages)
        child = branch_messages(opening, value)
        e.input_ids, e.loss_mask, e.behavior_logprobs, e.turn_index, e.messages = [], [], [], [], list(child)
        e.append(renderer.prompt_ids(child, tools), sampled=False, turn=-1)
        e.info["branches"] = e.info.get("branches", 0) + 1
        return False

    def _return(self, result: str, renderer, tools, turn: int) -> None:
        self._close_branch("fold" if result.strip() else "fold-empty")
        self._observe(Message(role="tool", content=result, name="branch"), renderer, tools, turn)

    def _observe(self, observation: Message, renderer, tools, turn: int) -> None:
        """Append an observation to the live sequence, unless no generation would ever see it."""
        e = self.episode
        if self.last:
            return
        delta = renderer.continuation_ids(e.messages, [observation], tools)
        if len(e.input_ids) + len(delta) >= self.max_total_tokens:
            e.truncation = "max_total_tokens"
            return
        e.append(delta, sampled=False, turn=turn)
        e.messages.append(observation)

    def _close_branch(self, ended_by: str) -> None:
        e = self.episode
        e.segments.append(Segment(e.input_ids, e.loss_mask, e.behavior_logprobs, e.turn_index, e.messages, ended_by))
        e.info["branch_tokens"] = e.info.get("branch_tokens", 0) + len(e.input_ids)
        e.input_ids, e.loss_mask, e.behavior_logprobs, e.turn_index, e.messages = self.parent
        self.parent = None

    def finish(self) -> None:
        if self.parent is not None:
            self._close_branch("fold-unfinished")


def _window(episode: Episode, observations: list, tools, renderer, limits: RolloutLimits) -> bool:
    """Drop the oldest whole turns so the next turn fits; a new segment from the rest. False: nothing fits."""
    budget = limits.context.max_context_tokens

    def fits(messages: list) -> bool:
        return len(renderer.prompt_ids(messages, tools)) + limits.max_new_tokens <= budget

    kept = window_messages([*episode.messages, *observations], fits)
    if kept is None:
        episode.truncation = "max_context"
        return False
    episode.start_segment(renderer.prompt_ids(kept, tools), kept, ended_by="window")
    episode.info["windows"] = episode.info.get("windows", 0) + 1
    return True


def sampling_params(limits: RolloutLimits, renderer, max_new_tokens: int, seed: int | None, counter: int,
                    purpose: str = "turn") -> SamplingParams:
    """One generation's sampling settings; a seeded episode seeds it with ``derive_seed(seed, counter)``."""
    return SamplingParams(temperature=limits.temperature, top_p=limits.top_p, top_k=limits.top_k,
                          max_new_tokens=max_new_tokens, stop_ids=(renderer.eos_id,),
                          seed=None if seed is None else derive_seed(seed, counter), purpose=purpose)


async def sample_aside(episode: Episode, ask: list[Message], tools, engine: Engine, renderer: ChatRenderer,
                       limits: RolloutLimits, *, max_new_tokens: int, seed: int | None, counter: int, purpose: str,
                       turn: int, ask_turn: int | None = None,
                       closed: bool = True) -> tuple[str, bool, int, int] | None:
    """Append ``ask`` (mask 0) after the last assistant message and sample one side generation (mask 1).

    The ``summarize`` manager's summary and the meta loop's reflection are both this: a request
    that is not an action turn, answered by the policy, its tokens trained. ``closed``: whether the
    last assistant message ended with its end-of-turn token. Returns (text, ended with the
    end-of-turn token, index of the first sampled token, sampled token count), or None, with
    nothing appended, when the sequence has no room left for it.
    """
    delta = renderer.continuation_ids(episode.messages, ask, tools, closed=closed)
    room = limits.max_total_tokens - len(episode.input_ids) - len(delta)
    if room <= 0:
        return None
    episode.append(delta, sampled=False, turn=turn if ask_turn is None else ask_turn)
    episode.messages.extend(ask)
    start = len(episode.input_ids)
    params = sampling_params(limits, renderer, min(max_new_tokens, room), seed, counter, purpose=purpose)
    completion = await engine.generate(list(episode.input_ids), params)
    episode.append(completion.token_ids, sampled=True, turn=turn, logprobs=completion.logprobs)
    finished = completion.finish_reason == "stop"
    text = renderer.decode(completion.token_ids[:-1] if finished else completion.token_ids)
    episode.messages.append(Message(role="assistant", content=text))
    return text, finished, start, len(completion.token_ids)


async def _summarize(episode: Episode, observations: list, opening: list, tools, engine, renderer,
                     limits: RolloutLimits, seed: int | None, turn: int) -> bool:
    """Show the observations and the summary instruction, sample a summary, restart from it.

    Returns False when the episode ends here (summary limit reached, or the summary did not fit).
    """
    policy = limits.context
    done = episode.info.get("summaries", 0)
    if done >= policy.max_summaries:
        episode.truncation = "max_context"
        return False
    ask = [*observations, Message(role="user", content=policy.instruction)]
    aside = await sample_aside(episode, ask, tools, engine, renderer, limits, max_new_tokens=policy.summary_max_tokens,
                               seed=seed, counter=SUMMARY_SEED_OFFSET + done, purpose="summary", turn=turn)
    if aside is None:
        episode.truncation = "max_total_tokens"
        return False
    summary, closed, _, tokens = aside
    episode.info["summaries"] = done + 1
    episode.info["summary_tokens"] = episode.info.get("summary_tokens", 0) + tokens
    if not closed:
        hit_total = len(episode.input_ids) >= limits.max_total_tokens
        episode.truncation = "max_total_tokens" if hit_total else "max_new_tokens"
        return False
    messages = restart_messages(opening, summary)
    episode.start_segment(renderer.prompt_ids(messages, tools), messages)
    if policy.over_budget(len(episode.input_ids), limits.max_new_tokens):
        episode.truncation = "max_context"  # task + summary alone leave no room for a turn
        return False
    return True


async def run_episodes(make_env: Callable[[], Any], tasks: list[Task], engine: Engine, renderer: ChatRenderer,
                       limits: RolloutLimits, *, group_size: int = 1, seed: int = 0,
                       demos: Callable[[int, int], list[Demo]] | None = None) -> list[Episode]:
    """Play ``group_size`` episodes per task concurrently; episode ``k`` of task ``i`` has group ``i``.

    Every environment is built and reset first, all of them before any generation: the engine's
    first batch then holds every episode whatever each reset took, so seeded runs repeat exactly.
    A constructor or reset that raises (or passes the deadline) gives an errored episode.

    ``demos(i, k)``: few-shot demonstrations for episode ``k`` of task ``i``, written before the
    task in its prompt (``with_demos``: context, mask 0); ``info["demos"]`` counts them. Training
    only: evaluation passes none.
    """
    jobs = []
    for group_id, task in enumerate(tasks):
        for k in range(group_size):
            jobs.append((task, group_id, seed * 1_000_003 + group_id * 1009 + k))
    shown = [demos(group_id, k) if demos is not None else [] for group_id in range(len(tasks))
             for k in range(group_size)]

    async def prepare(task: Task, episode_seed: int):
        t0 = time.perf_counter()
        try:
            env = make_env()
        except Exception as exc:  # noqa: BLE001 - an errored episode, not a crashed step
            return None, exc, time.perf_counter() - t0
        try:
            return env, await reset_env(env, task, episode_seed, limits.timeout_s), time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, asyncio.CancelledError):
                raise
            try:
                env.close()
            except Exception:  # noqa: BLE001
                pass
            return None, exc, time.perf_counter() - t0

    prepared = await asyncio.gather(*(prepare(task, s) for task, _, s in jobs))
    runs = []
    for (task, group_id, episode_seed), (env, opening, spent), chosen in zip(jobs, prepared, shown):
        if env is None:
            runs.append(_errored(task, group_id, engine, opening, limits, spent))
        else:
            runs.append(run_episode(env, task, engine, renderer, limits, seed=episode_seed, group_id=group_id,
                                    opening=with_demos(opening, chosen), spent_s=spent))
    episodes = list(await asyncio.gather(*runs))
    if demos is not None:
        for episode, chosen in zip(episodes, shown):
            episode.info["demos"] = len(chosen)
    return episodes


async def _errored(task: Task, group_id: int, engine: Engine, exc: BaseException, limits: RolloutLimits,
                   spent: float) -> Episode:
    episode = Episode(task=task, group_id=group_id, policy_version=getattr(engine, "version", 0))
    record_error(episode, exc, limits, spent)
    episode.info["seconds"] = spent
    return episode
