"""MCP tools beside an environment's own (``env.mcp_servers``; docs/mcp.md).

``with_mcp_tools(cls, env)`` (``env``: the ``[env]`` section, whose ``mcp_*`` fields it reads) is the environment
class a run plays when ``env.mcp_servers`` is set: ``cls``, whose ``make_tools`` also returns the servers' tools
(``ctxrl.tools.mcp``), after its own. The policy sees them all
in its tool-call format, as it sees the built-in ones, and ``ToolAnswerEnv.step`` runs them through the same
``execute_tool_calls``: the deadline, errors as observations, and ``ToolServerLost`` when a server dies. It checks
now, without starting anything (so ``ctxrl config`` does too), that the ``mcp`` extra is installed, that every
entry is a URL or a command line whose program exists, and that the environment answers tool calls from its
``tools`` list (every ``ToolAnswerEnv`` does; ``harness`` runs a user's agent, which brings its own tools).

``start_tools(env_cls)`` builds one environment and closes it: a rollout worker calls it before the first episode,
so a server that cannot start, two tools of one name, or a ``jsonl_tools`` task naming a tool nobody offers stops
the run at once, with one line, instead of erroring every episode. Just before, the worker's ``check_tasks`` (with
the model's tokenizer) starts the servers and refuses tools whose schemas alone take the context
(``check_schema_tokens``): every episode would be cut.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ctxrl.envs.base import EnvError
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.sections import EnvConfig
from ctxrl.tools.base import Tool
from ctxrl.tools.mcp import McpError, hub_key, mcp_hub, parse_server, require_mcp


def with_mcp_tools(cls: type, env: EnvConfig) -> type:
    """``cls`` with the tools of the MCP servers of ``env`` (``env.mcp_servers``) after its own (``cls`` itself without
    servers)."""
    if not env.mcp_servers:
        if env.mcp_tools.strip():
            raise EnvError(f"env.mcp_tools = {env.mcp_tools!r} names MCP tools, but env.mcp_servers is empty; add "
                           "the servers that offer them, or clear env.mcp_tools")
        return cls
    try:
        require_mcp()
    except McpError as exc:
        raise EnvError(str(exc)) from None
    for i, text in enumerate(env.mcp_servers):
        try:
            parse_server(text)
        except ValueError as exc:
            raise EnvError(f"env.mcp_servers[{i}]: {exc}") from None
    runner = getattr(cls, "runner", None)  # (an episode runner of its own: the harness's user agent)
    if runner:
        raise EnvError(f"env.mcp_servers gives the policy tools in ctxrl's agent loop, but {cls.__name__}'s episodes "
                       f"are played by the {runner!r} runner (a user's agent, which brings its own tools); give the "
                       "agent its MCP client, or clear env.mcp_servers")
    if not (isinstance(cls, type) and issubclass(cls, ToolAnswerEnv)):
        raise EnvError(f"env.mcp_servers adds tools to environments that answer tool calls from their tools list "
                       f"(ctxrl.envs.tool_answer.ToolAnswerEnv: jsonl_tools, calculator, ...); {cls.__name__} answers "
                       "them another way, so MCP tools cannot be added to it: build it on ToolAnswerEnv, or clear "
                       "env.mcp_servers")
    key = (cls, hub_key(env))  # (one class per environment and servers: a run's every lookup gets the same)
    if key not in _WITH_TOOLS:
        _WITH_TOOLS[key] = _with_tools(cls, env)
    return _WITH_TOOLS[key]


_WITH_TOOLS: dict[tuple, type] = {}


def _with_tools(cls: type, env: EnvConfig) -> type:
    own_tools = cls.make_tools

    def make_tools(self) -> list[Tool]:
        own = own_tools(self)
        offered = mcp_hub(env).tools()
        clash = sorted({t.name for t in own} & {t.name for t in offered})
        if clash:
            raise EnvError(f"MCP tool {clash[0]!r} has the name of one of {cls.name}'s own tools; leave it out with "
                           "env.mcp_tools, or rename it in its server")
        return [*own, *offered]

    own_check = getattr(cls, "check_tasks", None)

    def check_tasks(max_total_tokens: int, count_tokens: Callable[[str], int] | None = None) -> None:
        """The environment's own check, then, with the model's tokenizer (a rollout worker's start), the MCP tools'
        schemas against the context (``check_schema_tokens``)."""
        if own_check is not None:
            own_check(max_total_tokens, count_tokens)
        if count_tokens is not None:  # (not at ctxrl config, which starts no server)
            check_schema_tokens(mcp_hub(env).tools(), max_total_tokens, count_tokens)

    return type(cls.__name__, (cls,), {"make_tools": make_tools, "mcp_env": env, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                                       "check_tasks": staticmethod(check_tasks)})


def check_schema_tokens(tools: list[Tool], max_total_tokens: int, count_tokens: Callable[[str], int]) -> None:
    """An ``EnvError`` when the MCP tools' schemas, which every episode's prompt carries, take the whole context (as
    JSON, measured with ``count_tokens``): every episode would be cut before the policy wrote a token."""
    sizes = sorted(((count_tokens(json.dumps(t.schema(), ensure_ascii=False)), t.name) for t in tools), reverse=True)
    total = sum(n for n, _ in sizes)
    if total >= max_total_tokens:
        largest = ", ".join(f"{name}: {n}" for n, name in sizes[:3])
        raise EnvError(f"the MCP tools' schemas take {total} tokens of the model's tokenizer ({largest}), and every "
                       f"episode's prompt carries them: rollout.max_total_tokens = {max_total_tokens} cannot hold "
                       "them; leave tools out with env.mcp_tools, shorten their schemas in the server, or raise "
                       "rollout.max_total_tokens")


def start_tools(env_cls: type) -> list[Tool]:
    """The tools an episode of ``env_cls`` offers, from one environment built and closed now (module docstring)."""
    env = env_cls()
    try:
        return list(env.tools)
    finally:
        env.close()
