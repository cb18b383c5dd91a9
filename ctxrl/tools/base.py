"""Tools an agent can call, and the one function that executes a turn's tool calls.

A ``Tool`` is plain data (name, description, JSON-schema parameters) plus a function. The
schema is what the chat template shows the model; the function is what runs. Tools are async
so that many episodes can wait on slow tools (search, sandboxes) at once; a sync function is
run in a worker thread so it neither blocks the event loop nor escapes the timeout.

``execute_tool_calls`` follows STYLE lesson 9, *errors are data*: whatever the model wrote
(malformed JSON, an unknown tool, a wrong argument, a tool that raises or hangs) becomes an
``Error: ...`` observation the model can read and recover from, and is counted. It never
raises because of model output. The one exception it lets through is ``ToolServerLost``: the process
behind a tool (an MCP server, ``ctxrl.tools.mcp``) died, taking with it whatever state the episode had
built there, so the episode cannot go on faithfully; the agent loop records it as an errored episode
(``error_kind`` ``tool_server``), left out of the loss and counted.

What this file deliberately does not do: sandboxing (a tool is trusted code; a timed-out *sync*
tool keeps running in its daemon thread until it returns, because Python threads cannot be
killed, but nothing waits for it: ``ctxrl.tools.threads``), and full JSON-schema validation
(``validate_arguments`` covers the flat object-of-primitives schemas tools use; jsonschema is not
a dependency).
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ctxrl.tools.threads import in_daemon_thread
from ctxrl.types import Message

ToolFn = Callable[..., str | Awaitable[str]]

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What a tool's name may be (as OpenAI's API requires): letters, digits, ``_`` and ``-``, at most 64."""


class ToolFailed(Exception):
    """A tool reporting failure in its own words (an MCP server's ``isError`` result): the observation is
    ``Error: tool NAME failed: MESSAGE``, with no exception type in it."""


class ToolServerLost(RuntimeError):
    """The process behind a tool died during a call (see the module docstring): the episode is errored."""

# JSON-schema type name -> check on a value decoded from JSON.
_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


@dataclass
class Tool:
    """A callable tool with the JSON schema the model sees.

    ``fn`` receives the call's arguments as keyword arguments and returns the observation
    text; it may be ``async`` or plain. ``timeout_s`` bounds one call. ``checks_arguments``: ``fn``
    checks its arguments against ``parameters`` itself (an MCP server does), so the schema may use
    any JSON Schema (``anyOf``, ``$ref``, nested objects): it is shown to the model as given, only
    required to describe an object, and ``execute_tool_calls`` does not check calls against it. ``ready``: awaited
    before each call's deadline starts (an MCP server being started again after it died), so that ``timeout_s``
    bounds the call alone; the episode's own deadline still bounds both.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: ToolFn
    timeout_s: float = 10.0
    checks_arguments: bool = False
    ready: Callable[[], Awaitable[None]] | None = None

    def __post_init__(self) -> None:
        # Fail at construction, where the author is, not mid-rollout.
        if not TOOL_NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 characters of letters, digits, '_' or '-'")
        problems = object_schema_problems(self.parameters) if self.checks_arguments else schema_problems(
            self.parameters)
        if problems:
            raise ValueError(f"tool {self.name!r} has an invalid parameters schema: " + "; ".join(problems))
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if not self.timeout_s > 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")

    def schema(self) -> dict[str, Any]:
        """The OpenAI / HF ``tools=[...]`` entry for this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def __call__(self, **arguments: Any) -> str:
        """Run the tool without validation or timeout (``execute_tool_calls`` adds both)."""
        if _is_async(self.fn):
            result = await self.fn(**arguments)
        else:  # abandonable: a call past its timeout never holds up the step or the process exit
            result = await in_daemon_thread(self.fn, name=f"ctxrl-tool-{self.name}", **arguments)
            if inspect.isawaitable(result):  # e.g. a functools.partial over an async function
                result = await result
        # A tool that returns numbers or dicts is a small authoring slip, not a crash.
        return result if isinstance(result, str) else str(result)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def object_schema_problems(parameters: Any) -> list[str]:
    """Problems with a schema that need not be flat (``Tool.checks_arguments``): it must describe an object, with
    ``properties`` a dict where it has them (empty list = usable)."""
    if not isinstance(parameters, dict):
        return [f"parameters must be a dict (a JSON schema), got {type(parameters).__name__}"]
    problems = [] if parameters.get("type") == "object" else [
        f'parameters must have "type": "object", got {parameters.get("type")!r}']
    if not isinstance(parameters.get("properties", {}), dict):
        problems.append('"properties" must be a dict of name -> schema')
    return problems


def schema_problems(parameters: Any) -> list[str]:
    """Problems with a tool's ``parameters`` schema (empty list = usable).

    Requires what chat templates and ``validate_arguments`` rely on: an object schema with a
    ``properties`` dict of typed properties and a ``required`` list naming only properties.
    """
    if not isinstance(parameters, dict):
        return [f"parameters must be a dict (a JSON schema), got {type(parameters).__name__}"]
    problems: list[str] = []
    if parameters.get("type") != "object":
        problems.append(f'parameters must have "type": "object", got {parameters.get("type")!r}')
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        problems.append('"properties" must be a dict of name -> schema')
        properties = {}
    for prop, spec in properties.items():
        if not isinstance(spec, dict):
            problems.append(f"property {prop!r} must be a schema dict")
            continue
        types = spec.get("type")
        types = types if isinstance(types, list) else [types]
        if "enum" not in spec and not all(t in _TYPE_CHECKS for t in types):
            problems.append(f"property {prop!r} needs a JSON type (one of {sorted(_TYPE_CHECKS)}) or an enum")
        if "enum" in spec and not isinstance(spec["enum"], list):
            problems.append(f'property {prop!r}: "enum" must be a list')
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        problems.append('"required" must be a list of property names')
    else:
        missing = [r for r in required if r not in properties]
        if missing:
            problems.append(f'"required" names properties that are not defined: {missing}')
    additional = parameters.get("additionalProperties", True)
    if not isinstance(additional, (bool, dict)):
        problems.append('"additionalProperties" must be a bool or a schema')
    return problems


def validate_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """The first way ``arguments`` violates ``parameters``, as a sentence naming the field, or None.

    Covers ``type`` (including lists of types), ``required``, ``additionalProperties: false``
    and ``enum`` on the top-level properties; nested schemas are only type-checked.
    """
    properties: dict[str, Any] = parameters.get("properties", {})
    for name in parameters.get("required", []):
        if name not in arguments:
            return f"missing required argument {name!r}"
    if parameters.get("additionalProperties", True) is False:
        extra = [k for k in arguments if k not in properties]
        if extra:
            allowed = ", ".join(properties) or "none"
            return f"unexpected argument {extra[0]!r} (allowed: {allowed})"
    for name, value in arguments.items():
        spec = properties.get(name)
        if spec is None:
            continue
        types = spec.get("type")
        if types is not None:
            types = types if isinstance(types, list) else [types]
            if not any(_TYPE_CHECKS.get(t, lambda _v: True)(value) for t in types):
                return f"argument {name!r} must be {' or '.join(types)}, got {_json_type(value)}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {name!r} must be one of {spec['enum']}, got {value!r}"
    return None


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _TYPE_CHECKS[name](value):
            return name
    return type(value).__name__


def _error(content: str, name: str | None) -> Message:
    return Message(role="tool", content=f"Error: {content}", name=name)


async def execute_tool_calls(tools: list[Tool], message: Message) -> tuple[list[Message], dict[str, int]]:
    """Execute an assistant message's tool calls in order; return observations and counts.

    Returns one ``role="tool"`` message per malformed block (first, ``name=None``) and per
    call (``name`` = the called name), plus ``{"tool_calls", "tool_errors",
    "malformed_tool_calls"}`` where ``tool_calls`` counts every attempt, malformed included.
    Calls run one after another: tools may have side effects whose order the model chose.
    """
    by_name = {tool.name: tool for tool in tools}
    observations = [_error(err, None) for err in message.tool_call_errors]
    errors = len(message.tool_call_errors)
    for call in message.tool_calls:
        tool = by_name.get(call.name)
        if tool is None:
            available = ", ".join(sorted(by_name)) or "none"
            observations.append(_error(f"unknown tool {call.name!r}; available tools: {available}", call.name))
            errors += 1
            continue
        problem = None if tool.checks_arguments else validate_arguments(tool.parameters, call.arguments)
        if problem is not None:
            observations.append(_error(f"invalid arguments for tool {tool.name}: {problem}", tool.name))
            errors += 1
            continue
        try:
            if tool.ready is not None:
                await tool.ready()
            content = await asyncio.wait_for(tool(**call.arguments), timeout=tool.timeout_s)
        except asyncio.TimeoutError:
            observations.append(_error(f"tool {tool.name} timed out after {tool.timeout_s:g}s", tool.name))
            errors += 1
            continue
        except ToolServerLost:
            raise  # not the model's doing, and the episode cannot go on (the module docstring)
        except ToolFailed as exc:
            observations.append(_error(f"tool {tool.name} failed: {exc}", tool.name))
            errors += 1
            continue
        except Exception as exc:  # noqa: BLE001 - any tool failure is an observation, by design
            observations.append(_error(f"tool {tool.name} raised {type(exc).__name__}: {exc}", tool.name))
            errors += 1
            continue
        observations.append(Message(role="tool", content=content, name=tool.name))
    counts = {
        "tool_calls": len(message.tool_calls) + len(message.tool_call_errors),
        "tool_errors": errors,
        "malformed_tool_calls": len(message.tool_call_errors),
    }
    return observations, counts
