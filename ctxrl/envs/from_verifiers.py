"""``verifiers:ID``: a verifiers environment trained with ctxrl's own token-faithful rollouts.

verifiers (``pip install -e '.[verifiers]'``) packages an environment as a module with ``load_environment(**args)``
returning a ``vf.Environment``: a dataset of prompts (and answers), a parser, a rubric of weighted reward functions
and, for multi-turn environments, ``env_response`` (tools for a ``ToolEnv``, a game's replies, stop conditions).
``env.name = "verifiers:ID"`` loads one: ``ID`` is what ``vf.load_environment`` takes (an installed environment
package, ``my-env`` or ``my_env``, or any importable module), or a file, ``verifiers:path/to/env.py``;
``[env.verifiers] args`` are the keyword arguments of its ``load_environment``.

**How an episode maps.** ctxrl's agent loop samples every assistant turn, in the policy's own tool-call format, and
records the tokens (``ctxrl.rollout``); the verifiers environment does everything else, through its own methods, in
the order its ``MultiTurnEnv.rollout`` calls them: ``init_state`` and ``setup_state`` before the first turn; after
each turn the turn joins ``state["trajectory"]`` (``add_trajectory_step``), the stop conditions run
(``is_completed``), and otherwise ``get_prompt_messages`` (``env_response``: tool results, a game's reply) gives the
messages ctxrl appends; when a stop condition fires, the ``@vf.cleanup`` handlers render the completion and the
rubric scores it (``score_rollout``). Its reward is the episode's reward; the episode succeeds when the reward
reaches the environment's ``pass_threshold``; the rubric's metrics go into the last step's ``info``.

- Prompts are the dataset's ``prompt`` messages, system prompt and few-shot examples included. ``train`` is the
  environment's dataset and ``heldout`` its eval dataset; an environment with only one of them has it split by a
  stable hash of the prompt (``heldout_fraction``). There is no ``ood`` split and no context.
- Tools are the environment's ``tool_defs`` (or a row's ``info["tool_defs"]``), shown in the policy's format; the
  environment runs them itself in ``env_response``, with its own error messages. ctxrl's tool deadline does not
  apply; ``rollout.episode_timeout_s`` does. A call the policy writes that does not parse is plain text to the
  environment, as an OpenAI server would hand it over (a ``ToolEnv`` then stops: no tool was called).
- The assistant message the parser and rubric read is the sampled text, tool-call markup included.
- The gold solution (``solve``, for ``check-env`` and warm starts) is the module's own ``ctxrl_solution(row) ->
  list[str]`` where it defines one, else one turn: the row's ``answer`` as the parser formats it (an ``XMLParser``
  with an ``answer`` field) or bare.

What cannot be mapped faithfully, and is refused with a message saying so: an environment that is not a
``MultiTurnEnv`` or overrides ``rollout``, ``get_model_response`` or ``add_model_response`` (its model calls are not
ctxrl's turns: an ``EnvGroup``, a CLI agent); a rubric with group reward functions or its own advantages (ctxrl
scores each episode alone, and its estimator makes the advantages); a ``get_prompt_messages`` that rewrites the
conversation instead of extending it (ctxrl appends observations to what the model saw; a rewritten history is not
what was sampled), found when it happens and the episode errored; a ``setup_state`` that changes the prompt;
non-text message content. An episode that ctxrl cuts short (``env.max_turns``, ``rollout.max_total_tokens``) is not
scored by the rubric: its reward is 0, as for every ctxrl environment; keep ctxrl's limits above the environment's
own (its ``max_turns``) so that its stop conditions end episodes. A verifiers ``Environment`` installs SIGINT and
SIGTERM handlers when it is built; ctxrl puts its own back, so a training run still stops gracefully.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import tomllib

from ctxrl.envs.base import EnvError
from ctxrl.plugins import import_file
from ctxrl.tasks.space import ContextSpace, split_of, task_id
from ctxrl.tools.base import Tool, schema_problems
from ctxrl.types import SPLITS, Message, StepResult, Task, ToolCall

SUMMARY = ("a verifiers environment (verifiers:ID, an installed one or a module with load_environment; "
           "verifiers:path/to/env.py), its dataset, rubric and tools; the verifiers extra; docs/verifiers.md")
EXTRA = "pip install -e '.[verifiers]'"
UNMAPPED = ("rollout", "get_model_response", "add_model_response")
"""``MultiTurnEnv`` methods an environment may not override: its model calls would not be ctxrl's turns."""


@dataclass(frozen=True)
class Settings:
    """The table ``[env.verifiers]`` (``env.verifiers.KEY=VALUE`` on the command line)."""

    args: list[str] = field(default_factory=list)
    """Keyword arguments of the environment's ``load_environment``, each ``NAME=VALUE`` with a TOML value
    (``num_examples=200``, ``difficulty="easy"``; a value that is not TOML is a string)."""
    heldout_fraction: float = 0.2
    """For an environment with only one dataset: the share of its prompts that are ``heldout``."""
    max_examples: int = 0
    """Read at most this many rows of each dataset (0: all of them)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.max_examples < 0:
            raise ValueError(f"max_examples must be >= 0 (0: all rows), got {self.max_examples}")
        load_args(self.args)


def load_args(items: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` items as keyword arguments (values read as TOML, else as strings)."""
    args = {}
    for item in items:
        name, sep, text = item.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name.isidentifier():
            raise ValueError(f"args entry {item!r} must look like NAME=VALUE (a keyword of load_environment)")
        try:
            args[name] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            args[name] = text
    return args


def _verifiers():
    try:
        import verifiers
    except ImportError:
        raise EnvError(f"verifiers environments need the verifiers package: {EXTRA}") from None
    if not hasattr(verifiers, "MultiTurnEnv"):
        raise EnvError(f"verifiers {getattr(verifiers, '__version__', '?')} has no vf.Environment API (0.4 keeps only "
                       f"verifiers.v1); {EXTRA} installs the release ctxrl maps (0.2.0)")
    return verifiers


def environment(rest: str) -> type:
    """The class ``verifiers:REST`` names (loaded when first used)."""
    if not rest.strip():
        raise EnvError("verifiers: names no environment; write verifiers:ID (an installed verifiers environment or "
                       "a module with load_environment) or verifiers:path/to/env.py")
    _verifiers()
    return _environment_class(rest.strip())


@functools.cache
def _environment_class(source: str) -> type:
    return type(f"Verifiers[{source}]", (VerifiersEnv,), {"source": source, "name": f"verifiers:{source}"})


# -- loading: the environment, its tasks, checked once per configured class -----------------------------------------
@dataclass
class Loaded:
    """A verifiers environment and what ctxrl reads from it once."""

    env: Any
    module: Any
    tasks: dict[str, list[Task]]


def _module(source: str):
    """The environment's module: a file, or what ``vf.load_environment`` imports for an id."""
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise EnvError(f"verifiers:{source}: no such file")
        return import_file(path, "ctxrl_verifiers")
    from verifiers.utils.env_utils import import_env_module

    try:
        return import_env_module(source)
    except ImportError as exc:
        raise EnvError(f"verifiers:{source}: cannot import its module ({exc}); install the environment's package "
                       "(prime env install, or pip) or name a file, verifiers:path/to/env.py") from None


def load(source: str, settings: Settings) -> Loaded:
    """Build the environment (keeping ctxrl's signal handlers), check that it maps, and read its tasks."""
    module = _module(source)
    if not callable(getattr(module, "load_environment", None)):
        raise EnvError(f"verifiers:{source}: module {module.__name__} has no load_environment()")
    from datasets.utils import logging as datasets_logging

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    bars = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()  # a bar per dataset.map would interleave with ctxrl's own progress
    try:
        env = module.load_environment(**load_args(settings.args))
        _check_mappable(env, source)
        return Loaded(env=env, module=module, tasks=_tasks(env, source, settings))
    except EnvError:
        raise
    except Exception as exc:
        raise EnvError(f"verifiers:{source}: loading it raised {type(exc).__name__}: {exc}") from exc
    finally:
        if bars:
            datasets_logging.enable_progress_bar()
        for sig, handler in handlers.items():  # vf.Environment's own would skip ctxrl's graceful stop
            if handler is not None:
                signal.signal(sig, handler)


def _check_mappable(env: Any, source: str) -> None:
    vf = _verifiers()
    where = f"verifiers:{source} ({type(env).__name__})"
    if not isinstance(env, vf.MultiTurnEnv):
        raise EnvError(f"{where} is not a MultiTurnEnv: ctxrl plays the turns of MultiTurnEnv, SingleTurnEnv, "
                       "ToolEnv and their subclasses; its own rollout cannot be mapped to ctxrl's turns")
    overridden = [m for m in UNMAPPED if getattr(type(env), m) is not getattr(vf.MultiTurnEnv, m)]
    if overridden:
        raise EnvError(f"{where} overrides {', '.join(overridden)}: its model calls are its own, not ctxrl's "
                       "sampled turns, so they cannot be trained token-faithfully")
    if env.rubric.has_group_rewards or env.rubric.has_advantages:
        raise EnvError(f"{where} has group reward functions or its own advantages: ctxrl scores each episode "
                       "alone and its estimator (algo.advantage) makes the advantages")


def _tasks(env: Any, source: str, settings: Settings) -> dict[str, list[Task]]:
    """The rows of the environment's datasets as tasks, by split (see the module docstring)."""
    has_train = env.dataset is not None or env.dataset_source is not None
    has_eval = env.eval_dataset is not None or env.eval_dataset_source is not None
    n = settings.max_examples if settings.max_examples > 0 else -1
    tasks: dict[str, list[Task]] = {s: [] for s in SPLITS}
    if has_train and has_eval:
        tasks["train"] = [_task(row, "train") for row in env.get_dataset(n=n)]
        tasks["heldout"] = [_task(row, "heldout") for row in env.get_eval_dataset(n=n)]
    else:
        for row in (env.get_dataset(n=n) if has_train else env.get_eval_dataset(n=n)):
            key = json.dumps(_plain(row).get("prompt"), sort_keys=True)
            split = split_of(key, settings.heldout_fraction)
            tasks[split].append(_task(row, split))
    if not tasks["train"]:
        raise EnvError(f"verifiers:{source}: its dataset holds no training rows")
    return tasks


def _plain(value: Any) -> Any:
    """A dataset row as JSON values (what a ``Task`` may hold)."""
    return json.loads(json.dumps(value, default=str))


def _task(row: dict[str, Any], split: str) -> Task:
    row = _plain(row)
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise EnvError(f"a verifiers dataset row has no prompt messages: {str(row)[:200]}")
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    text = _text(users[-1].get("content")) if users else json.dumps(prompt)
    answer = row.get("answer")
    key = json.dumps([prompt, row.get("example_id"), row.get("answer")], sort_keys=True)
    return Task(id=task_id("verifiers", key), prompt=text,
                answer="" if answer is None else str(answer), context={}, split=split, data={"row": row})


def _text(content: Any) -> str:
    """A message's content as text (a list of text parts joined); other content is not mapped."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise EnvError(f"a verifiers message has content that is not text ({str(content)[:100]}); ctxrl trains on text")


# -- messages and tools, both ways ---------------------------------------------------------------------------------
def to_ctxrl(message: Any, names: dict[str, tuple[str, str | None]]) -> Message:
    """A verifiers message as ctxrl's; ``names`` maps the ids of calls this episode made to (tool, ctxrl id)."""
    role = message.role
    if role == "tool":
        name, call_id = names.get(message.tool_call_id, (None, None))
        return Message(role="tool", content=_text(message.content), name=name, tool_call_id=call_id)
    calls = [ToolCall(name=c.name, arguments=_arguments(c.arguments), id=c.id)
             for c in (getattr(message, "tool_calls", None) or [])]
    return Message(role="user" if role == "text" else role, content=_text(message.content), tool_calls=calls)


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _schema(tool: Any) -> dict[str, Any]:
    """A tool's parameters as ctxrl shows them: ``anyOf`` of plain types (an ``Optional`` argument) as a type
    list, which means the same."""
    parameters = json.loads(json.dumps(tool.parameters))
    for spec in (parameters.get("properties") or {}).values():
        options = spec.get("anyOf") if isinstance(spec, dict) else None
        if isinstance(options, list) and all(isinstance(o, dict) and set(o) == {"type"} for o in options):
            spec["type"] = [o["type"] for o in options]
            del spec["anyOf"]
    return parameters


def _tools(defs: list[Any]) -> list[Tool]:
    """Schemas the policy sees; the environment runs the calls itself (``env_response``)."""
    tools = []
    for tool in defs:
        parameters = _schema(tool)
        problems = schema_problems(parameters)
        if problems:
            raise EnvError(f"verifiers tool {tool.name!r} has a schema ctxrl cannot show the policy: "
                           f"{'; '.join(problems)}")
        tools.append(Tool(name=tool.name, description=tool.description or "", parameters=parameters, fn=_elsewhere))
    return tools


def _elsewhere(**_: Any) -> str:
    raise EnvError("a verifiers environment runs its tools in its own env_response; ctxrl never calls them")


def _response(assistant: Any) -> Any:
    """The ``vf.Response`` a chat-completions client would have returned for this turn (no usage: the tokens are
    ctxrl's)."""
    from verifiers.types import Response, ResponseMessage

    message = ResponseMessage(content=assistant.content, tool_calls=assistant.tool_calls, is_truncated=False,
                              finish_reason="tool_calls" if assistant.tool_calls else "stop")
    return Response(id=f"ctxrl-{uuid.uuid4().hex}", created=int(time.time()), model="ctxrl", message=message)


# -- the environment ------------------------------------------------------------------------------------------------
_LOADED: dict[type, Loaded] = {}


class VerifiersEnv:
    """A verifiers environment played by ctxrl's agent loop (see the module docstring)."""

    Settings: ClassVar[type] = Settings
    options: ClassVar[Settings] = Settings()
    source: ClassVar[str] = ""
    name: ClassVar[str] = "verifiers"
    system_prompt: ClassVar[str] = ""
    context_space: ClassVar[ContextSpace] = ContextSpace([])

    @classmethod
    def loaded(cls) -> Loaded:
        """The environment under this class's settings, built once (on first use, not when the name resolves)."""
        if not cls.source:
            raise EnvError("name a verifiers environment: env.name = \"verifiers:ID\"")
        if cls not in _LOADED:
            _LOADED[cls] = load(cls.source, cls.options)
        return _LOADED[cls]

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if cls.loaded().tasks[s])

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """``n`` rows of ``split`` drawn with replacement (seeded)."""
        pool = cls.loaded().tasks.get(split) or []
        if not pool:
            raise EnvError(f"{cls.name} has no {split!r} tasks (it has {', '.join(cls.splits())})")
        rng = random.Random(f"ctxrl-verifiers:{seed}:{split}")
        return [rng.choice(pool) for _ in range(n)]

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """The module's ``ctxrl_solution(row)``, else the answer as the parser writes it (module docstring)."""
        loaded = cls.loaded()
        row = task.data["row"]
        custom = getattr(loaded.module, "ctxrl_solution", None)
        if callable(custom):
            return list(custom(row))
        if not task.answer:
            raise EnvError(f"{cls.name}: the row has no answer and the module defines no ctxrl_solution(row)")
        parser = loaded.env.parser
        if isinstance(parser, _verifiers().XMLParser):
            return [parser.format(**{parser.answer_field: task.answer})]
        return [task.answer]

    def __init__(self) -> None:
        self.env = type(self).loaded().env
        self.tools: list[Tool] = _tools(self.env.tool_defs or [])
        self._row: dict[str, Any] | None = None
        self._state: Any = None
        self._prompt: list[Any] = []
        self._names: dict[str, tuple[str, str | None]] = {}
        self._done = False

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        """The row's prompt messages; the environment's state starts with the first turn, on the episode's loop."""
        from verifiers.utils.message_utils import normalize_messages

        self.close()
        self._row = task.data.get("row")
        if not isinstance(self._row, dict):
            raise EnvError(f"task {task.id} has no data['row']; draw {type(self).name} tasks with sample_tasks")
        info = self._row.get("info")
        info = json.loads(info) if isinstance(info, str) and info else info
        defs = info.get("tool_defs") if isinstance(info, dict) and info.get("tool_defs") else None
        if defs is not None:
            self.tools = _tools(self.env._normalize_tool_defs(defs))
        self._prompt = normalize_messages(self._row["prompt"], field_name="prompt")
        return [to_ctxrl(m, {}) for m in self._prompt]

    async def _start(self) -> None:
        vf = _verifiers()
        row = {k: v for k, v in self._row.items() if k in ("prompt", "example_id", "answer", "info", "task")}
        state = await self.env.init_state(row, client=_no_model_client()(), model="ctxrl", sampling_args={})
        try:
            state = await self.env.setup_state(state) or state
        except vf.Error as exc:
            state["error"] = exc
        if [m.model_dump() for m in state["prompt"]] != [m.model_dump() for m in self._prompt]:
            raise EnvError("the environment's setup_state changed the prompt after the model saw it; ctxrl shows "
                           "the dataset's prompt and cannot take it back")
        self._state = state
        if await self.env.is_completed(state):
            await self._end(state)
            raise EnvError(f"the environment stopped ({state.get('stop_condition')}) before the first turn"
                           + (f": {state['error']}" if state.get("error") else ""))

    async def step(self, message: Message) -> StepResult:
        """The turn joins the trajectory; the stop conditions run; the environment replies, or the rubric scores."""
        if self._row is None:
            raise EnvError("step() called before reset(task); start an episode with reset first")
        if self._done:
            raise EnvError("step() called after the episode terminated; call reset(task) to start a new episode")
        if self._state is None:
            await self._start()
        state, assistant = self._state, self._assistant(message)
        counts = {"tool_calls": len(message.tool_calls) + len(message.tool_call_errors),
                  "malformed_tool_calls": len(message.tool_call_errors)}
        previous = [*self._prompt, assistant]
        await self.env.add_trajectory_step(state, _trajectory_step(state, self._prompt, assistant))
        if not await self.env.is_completed(state):
            self._prompt = await self._next_prompt(state, previous)
            if state.get("final_env_response") is None and not await self.env.is_completed(state):
                new = self._prompt[len(previous):]
                return StepResult(messages=[to_ctxrl(m, self._names) for m in new], info=counts)
        return await self._scored(state, counts)

    def _assistant(self, message: Message) -> Any:
        from verifiers.types import AssistantMessage
        from verifiers.types import ToolCall as VfToolCall

        calls = []
        for i, call in enumerate(message.tool_calls):
            vf_id = call.id or f"call_{len(self._state['trajectory'])}_{i}"
            self._names[vf_id] = (call.name, call.id)
            calls.append(VfToolCall(id=vf_id, name=call.name, arguments=json.dumps(call.arguments)))
        return AssistantMessage(content=message.content, tool_calls=calls or None)

    async def _next_prompt(self, state: Any, previous: list[Any]) -> list[Any]:
        """``get_prompt_messages`` (the environment's reply), checked to extend what the model saw."""
        vf = _verifiers()
        from verifiers.utils.message_utils import maybe_normalize_messages

        try:
            prompt = maybe_normalize_messages(await self.env.get_prompt_messages(state), field_name="prompt")
        except vf.Error as exc:  # as MultiTurnEnv.rollout does: the error stops the rollout (has_error)
            state["error"] = exc
            return previous
        if len(prompt) < len(previous) or any(a is not b and a.model_dump() != b.model_dump()
                                              for a, b in zip(prompt, previous)):
            raise EnvError(f"{type(self).name} rewrote the conversation in get_prompt_messages instead of "
                           "extending it; ctxrl appends to what the model saw, and cannot train on a rewritten "
                           "history (docs/verifiers.md)")
        return prompt

    async def _end(self, state: Any) -> None:
        self._done = True
        await self.env.cleanup(state)

    async def _scored(self, state: Any, counts: dict[str, int]) -> StepResult:
        await self._end(state)
        if state.get("error") is not None:
            raise EnvError(f"the verifiers environment stopped with an error: {state['error']!r}")
        await self.env.rubric.score_rollout(state)
        await self.env.rubric.cleanup(state)
        reward = float(state.get("reward") or 0.0)
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, (int, float))}
        return StepResult(messages=[], reward=reward, terminated=True,
                          info={**counts, "success": reward >= float(self.env.pass_threshold),
                                "stop_condition": str(state.get("stop_condition")), "metrics": metrics})

    def close(self) -> None:
        """Forget the episode; an episode ctxrl cut short gets the environment's cleanup handlers run."""
        state, self._state = self._state, None
        if state is not None and not self._done:
            _run_now(self.env.cleanup(state))
        self._row, self._prompt, self._names, self._done = None, [], {}, False


def _trajectory_step(state: Any, prompt: list[Any], assistant: Any) -> dict[str, Any]:
    return {"prompt": list(prompt), "completion": [assistant], "response": _response(assistant), "tokens": None,
            "reward": None, "advantage": None, "is_truncated": False, "trajectory_id": state["trajectory_id"],
            "extras": {}}


def _run_now(coro: Any) -> None:
    """Run ``coro`` to its end from synchronous code (``close``), inside a running event loop or not: there, on a
    loop of its own in a worker thread (an episode's loop shuts down with the episode and would drop a task)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, coro).result()


@functools.cache
def _no_model_client() -> type:
    """The client ``init_state`` keeps: ctxrl samples the turns, so a model call from inside the environment's own
    methods is refused (a ``vf.Error``: the rollout stops with it, and the episode is errored)."""
    vf = _verifiers()

    class NoModel(vf.Client):
        def __init__(self) -> None:
            super().__init__(None)

        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            raise _refused()

        async def to_native_prompt(self, messages):
            raise _refused()

        async def get_native_response(self, *args, **kwargs):
            raise _refused()

        async def raise_from_native_response(self, response):
            raise _refused()

        async def from_native_response(self, response):
            raise _refused()

        async def close(self) -> None:
            return None

    return NoModel


def _refused() -> Exception:
    return _verifiers().Error("ctxrl samples the policy's turns itself; a verifiers environment that calls the "
                              "model from inside its own methods cannot be trained token-faithfully")
