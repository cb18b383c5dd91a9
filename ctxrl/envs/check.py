"""``check_env``: a conformance suite that tells an environment's author what is wrong.

Like Gymnasium's ``check_env``, it drives the environment the way the rollout will and
reports every problem it finds as a sentence saying what is wrong and how to fix it, instead
of stopping at the first. The checks:

- ``sample_tasks`` is reproducible (same seed -> same tasks; another seed -> other tasks),
  labels tasks with their split, draws contexts valid for that split (ood ones outside the
  train range when the space has an OOD range), and keeps train and heldout prompts disjoint;
- the tools' parameter schemas are JSON-schema objects;
- ``reset`` returns ``Message`` s and is deterministic for a task and seed;
- replaying the gold ``solve`` texts through ``parse_assistant`` and ``step`` earns a total
  reward of exactly 1.0 on every split, and ends the episode (``tool_format``: the texts' Hermes
  calls are first rewritten into that format and parsed with it, as a policy of that family
  would write them);
- ``step`` after the end raises ``EnvError``; ``close`` can be called twice.

A multi-role environment (``ctxrl.envs.roles``) shares the sampling, tool and close checks; its seats, reset
and gold play are checked by ``ctxrl.envs.check_roles`` (the gold turns in play order must give each seat its
``gold_rewards``).

It does not check that rewards are *only* 1.0 for right answers; test that in the env's tests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ctxrl.chat.formats import get_format, parse_assistant, rewrite_calls
from ctxrl.chat.toolcalls import HERMES
from ctxrl.envs.base import Env, EnvError
from ctxrl.envs.check_roles import gold_problems, table_problems
from ctxrl.envs.hooks import available_splits
from ctxrl.envs.roles import MultiRoleEnv, is_multi_role
from ctxrl.tasks.space import ContextError
from ctxrl.tools.base import Tool, object_schema_problems, schema_problems
from ctxrl.types import SPLITS, Message, StepResult, Task

T = TypeVar("T")
_REQUIRED = ("name", "context_space", "system_prompt", "reset", "step", "close", "sample_tasks", "solve")


class CheckEnvError(AssertionError):
    """Raised by ``assert_env_ok``; ``problems`` holds every problem found."""

    def __init__(self, env_name: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"environment {env_name} failed {len(problems)} check(s):\n- " + "\n- ".join(problems))


def assert_env_ok(env_cls: type, *, n_tasks: int = 8, seed: int = 0) -> None:
    """Raise ``CheckEnvError`` listing every problem ``check_env`` finds."""
    problems = check_env(env_cls, n_tasks=n_tasks, seed=seed)
    if problems:
        raise CheckEnvError(getattr(env_cls, "__name__", str(env_cls)), problems)


def check_env(env_cls: type, *, n_tasks: int = 8, seed: int = 0, notes: list[str] | None = None,
              tool_format: str = "hermes") -> list[str]:
    """Every problem found with ``env_cls`` (an empty list means it conforms).

    ``notes`` (if given) receives what was not checked and why: a split the environment has no
    tasks for (its ``splits()`` hook), which training and evaluation skip too.
    """
    missing = [attr for attr in _REQUIRED if not hasattr(env_cls, attr)]
    if missing:
        return [f"{env_cls.__name__} lacks {missing}; an environment needs {list(_REQUIRED)} (see ctxrl/envs/base.py)"]
    problems: list[str] = []
    tasks: dict[str, list[Task]] = {}
    have = _call(problems, "splits()", available_splits, env_cls) or ()
    if "train" not in have:
        problems.append(f"{env_cls.__name__} has no 'train' tasks (splits() says {list(have)}); training needs them")
    for split in SPLITS:
        if split not in have:
            if notes is not None:
                notes.append(f"no {split!r} tasks: the {split} split is skipped (here, in training and in evaluation)")
            continue
        drawn = _check_sampling(env_cls, split, n_tasks, seed, problems)
        if drawn:
            tasks[split] = drawn
    if "train" in have and "heldout" in have:
        _check_disjoint(env_cls, n_tasks, seed, problems)
    try:
        env = env_cls()
    except Exception as exc:  # noqa: BLE001 - report, don't crash the checker
        return problems + [f"{env_cls.__name__}() raised {type(exc).__name__}: {exc}; environments must be "
                           "constructible with no arguments (give config fields defaults)"]
    multi = is_multi_role(env_cls)
    try:
        if not isinstance(env, MultiRoleEnv if multi else Env):
            problems.append(f"{env_cls.__name__} instances do not satisfy the {'MultiRoleEnv' if multi else 'Env'} "
                            "protocol; set self.tools (a list of Tool) in __init__")
        _check_tools(env, problems)
        if multi:
            table = table_problems(env_cls, tasks, seed)
            problems += table or _run(gold_problems(env_cls, tasks, seed, lambda text: _parsed(text, tool_format)))
        else:
            if tasks:
                _check_reset(env_cls, next(iter(tasks.values()))[0], seed, problems)
            _run(_check_gold(env_cls, tasks, seed, problems, tool_format))
    finally:
        _close_twice(env, problems)
    return problems


def _call(problems: list[str], what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        problems.append(f"{what} raised {type(exc).__name__}: {exc}")
        return None


def _check_sampling(env_cls: type, split: str, n: int, seed: int, problems: list[str]) -> list[Task] | None:
    where = f"sample_tasks({split!r}, {n}, seed={seed})"
    first = _call(problems, where, env_cls.sample_tasks, split, n, seed)
    if first is None:
        return None
    if not isinstance(first, list) or len(first) != n or not all(isinstance(t, Task) for t in first):
        problems.append(f"{where} must return a list of {n} ctxrl.types.Task, got {type(first).__name__} "
                        f"of length {len(first) if hasattr(first, '__len__') else '?'}")
        return None
    for task in first:  # tasks cross process boundaries (rollout workers) as JSON
        try:
            back = Task.from_dict(json.loads(json.dumps(task.to_dict())))
        except (TypeError, ValueError) as exc:
            problems.append(f"{where}: task {task.id} is not plain data ({exc}); keep Task.data and Task.context "
                            "to JSON values: dicts with string keys, lists, strings, numbers, booleans, None")
            break
        if back != task:
            problems.append(f"{where}: task {task.id} changes on a JSON round trip (a tuple comes back as a list); "
                            "keep Task.data and Task.context to JSON values (lists, not tuples)")
            break
    again = _call(problems, where, env_cls.sample_tasks, split, n, seed)
    if again is not None and [t.to_dict() for t in again] != [t.to_dict() for t in first]:
        problems.append(f"{where} is not reproducible: two calls returned different tasks; draw everything "
                        "from a random.Random seeded by (seed, split), never from global random state")
    other = _call(problems, where, env_cls.sample_tasks, split, n, seed + 1)
    varied = len({t.prompt for t in first}) > 1  # a split of one task gives the same draw for every seed
    if varied and other is not None and [t.prompt for t in other] == [t.prompt for t in first]:
        problems.append(f"{where} ignores the seed: seed={seed + 1} returned the same prompts")
    space = env_cls.context_space
    for task in first:
        if task.split != split:
            problems.append(f"{where} returned task {task.id} with split={task.split!r}; set Task.split={split!r}")
            break
        try:
            space.validate(task.context, split=split)
        except ContextError as exc:
            problems.append(f"{where}: task {task.id} has a context not valid for split {split!r}: {exc}")
            break
        if split == "ood" and space.has_ood and not space.is_ood(task.context):
            problems.append(f"{where}: task {task.id} has context {task.context} inside the train ranges; "
                            "ood tasks must draw from [ood_low, ood_high]")
            break
    ids: dict[str, str] = {}
    for task in first:
        if ids.setdefault(task.id, task.prompt) != task.prompt:
            problems.append(f"{where}: id {task.id} is shared by different prompts; derive ids from a hash "
                            "of the prompt (ctxrl.tasks.task_id)")
            break
    return first


def _check_disjoint(env_cls: type, n: int, seed: int, problems: list[str]) -> None:
    # Larger draws than n: leaks are rare events per prompt, so look at more prompts.
    k = max(8 * n, 64)
    train = _call(problems, "sample_tasks('train')", env_cls.sample_tasks, "train", k, seed)
    heldout = _call(problems, "sample_tasks('heldout')", env_cls.sample_tasks, "heldout", k, seed)
    if train is None or heldout is None:
        return
    shared = sorted({t.prompt for t in train} & {t.prompt for t in heldout})
    if shared:
        problems.append(f"train and heldout share {len(shared)} prompt(s), e.g. {shared[0]!r}; reject prompts "
                        "of the other split with ctxrl.tasks.split_of (or use ctxrl.tasks.sample_tasks)")


def _check_tools(env: Any, problems: list[str]) -> None:
    tools = getattr(env, "tools", None)
    if not isinstance(tools, list) or not all(isinstance(t, Tool) for t in tools):
        problems.append("env.tools must be a list of ctxrl.tools.Tool")
        return
    for tool in tools:
        check = object_schema_problems if tool.checks_arguments else schema_problems
        for problem in check(tool.schema()["function"]["parameters"]):
            problems.append(f"tool {tool.name!r}: {problem}")


def _check_reset(env_cls: type, task: Task, seed: int, problems: list[str]) -> None:
    results = []
    for _ in range(2):
        env = _call(problems, f"{env_cls.__name__}()", env_cls)
        if env is None:
            return
        messages = _call(problems, f"reset(task {task.id})", env.reset, task, seed=seed)
        _call(problems, "close()", env.close)
        if messages is None:
            return
        if not isinstance(messages, list) or not all(
            isinstance(m, Message) and isinstance(m.role, str) and isinstance(m.content, str) for m in messages
        ):
            problems.append("reset() must return a list of ctxrl.types.Message with str role and content")
            return
        results.append([m.to_dict() for m in messages])
    if results[0] != results[1]:
        problems.append(f"reset(task {task.id}, seed={seed}) is not deterministic: two fresh environments "
                        "returned different messages; derive any randomness from the task and seed")


async def _check_gold(env_cls: type, tasks: dict[str, list[Task]], seed: int, problems: list[str],
                      tool_format: str) -> None:
    for split, split_tasks in tasks.items():
        for task in split_tasks:
            problem = await _replay_gold(env_cls, task, seed, tool_format)
            if problem:
                problems.append(f"gold solution on {split} task {task.id} ({task.prompt!r}): {problem}")
                break  # one example per split is enough to act on


async def _replay_gold(env_cls: type, task: Task, seed: int, tool_format: str = "hermes") -> str | None:
    try:
        texts = env_cls.solve(task)
    except Exception as exc:  # noqa: BLE001
        return f"solve() raised {type(exc).__name__}: {exc}"
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        return "solve() must return a non-empty list of assistant texts"
    env = env_cls()
    try:
        env.reset(task, seed=seed)
        total, result = 0.0, None
        for i, text in enumerate(texts):
            if result is not None and result.terminated:
                return f"the episode terminated after turn {i} but solve() returned {len(texts)} turns"
            try:
                result = await env.step(_parsed(text, tool_format))
            except Exception as exc:  # noqa: BLE001
                return f"step() on gold turn {i} ({text!r}) raised {type(exc).__name__}: {exc}"
            if not isinstance(result, StepResult):
                return f"step() must return a StepResult, got {type(result).__name__}"
            if not all(isinstance(m, Message) for m in result.messages):
                return "step() must return StepResult.messages as a list of Message"
            total += result.reward
        if result is None or not result.terminated:
            return "the episode did not terminate after the last gold turn; end it with terminated=True"
        if abs(total - 1.0) > 1e-9:
            return (f"total reward {total} != 1.0; check that solve() writes the answer exactly as step() "
                    "parses it and that task.answer is right")
        try:
            await env.step(Message(role="assistant", content="<answer>0</answer>"))
        except EnvError:
            pass
        except Exception as exc:  # noqa: BLE001
            return f"step() after termination raised {type(exc).__name__}, should raise ctxrl.envs.EnvError"
        else:
            return "step() after termination did not raise; raise ctxrl.envs.EnvError with a clear message"
        return None
    finally:
        env.close()


def play_solution(env_cls: type, task: Task, seed: int = 0, tool_format: str = "hermes") -> tuple[list[Message], float]:
    """The episode ``solve(task)`` plays through ``reset`` and ``step``: every message (opening,
    assistant turns, observations) and the total reward. No checks: see ``check_env`` for those.
    ``tool_format``: the format the assistant turns write their calls in (``solve`` writes Hermes)."""
    messages, reward, _ = play_solution_with_tools(env_cls, task, seed, tool_format)
    return messages, reward


def play_solution_with_tools(env_cls: type, task: Task, seed: int = 0,
                             tool_format: str = "hermes") -> tuple[list[Message], float, list[dict]]:
    """``play_solution`` and the tool schemas the episode offered (read after ``reset``)."""
    env = env_cls()
    try:
        messages, reward = list(env.reset(task, seed=seed)), 0.0
        schemas = [tool.schema() for tool in env.tools]
        for text in env_cls.solve(task):
            message = _parsed(text, tool_format)
            messages.append(Message(role="assistant", content=message.content))
            result = _run(env.step(message))
            messages += result.messages
            reward += result.reward
            if result.terminated:
                break
        return messages, reward, schemas
    finally:
        env.close()


def _parsed(text: str, tool_format: str) -> Message:
    """A gold text (Hermes calls) as a policy writing ``tool_format`` would write it, parsed with that format."""
    target = get_format(tool_format)
    return parse_assistant(target, rewrite_calls(text, target, HERMES))


def _close_twice(env: Any, problems: list[str]) -> None:
    for attempt in ("first", "second"):
        try:
            env.close()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"close() raised {type(exc).__name__} on the {attempt} call: {exc}; make it idempotent")
            return


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, also from inside a running loop (notebooks, async tests)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
