"""MCP tool servers as ctxrl tools (``env.mcp_servers``; docs/mcp.md).

Each entry of ``env.mcp_servers`` is one server: the URL of a streamable-HTTP server
(``http://127.0.0.1:8000/mcp``) or a command line that starts one speaking MCP over stdio (``python
my_server.py --db x``). Leading ``NAME=value`` words set variables in the server's environment, as in a
shell; otherwise it gets the MCP SDK's safe subset of ours (``HOME``, ``PATH``, ...). A command whose program
is ``python`` or ``python3`` runs with the interpreter that runs ctxrl, so a server written with the ``mcp``
package finds it without an activated virtual environment. ``McpHub`` starts or connects to every server,
lists their tools (all of them, or the ones ``env.mcp_tools`` names), and makes each a ``Tool`` whose schema
is the server's input schema (``ctxrl.tools.mcp_content``), checked against JSON Schema's own metaschema first (an
invalid one is an ``McpError`` naming the server and the tool); calling it sends ``tools/call``. A lone surrogate
in a description, a schema or a result is U+FFFD (``ctxrl.chat.surrogates``).

Why a thread: a rollout worker plays each request in its own event loop (``asyncio.run``), an MCP session
belongs to the loop it was opened in, and starting a server per request or per episode would cost a second or
more each time. The hub runs one event loop in a daemon thread for the life of the run; a call from any
episode's loop is handed to it (``run_coroutine_threadsafe``) and awaited, so one session per server serves
every episode at once, and cancelling the call (the tool deadline, ``env.mcp_timeout_s``) cancels the request
on the server.

What happens when something fails, none of it a crash of the run:

- a result the server marks ``isError``, an MCP error answer, the deadline: the model's observation (``Error:
  ...``), counted in ``tool_errors``;
- the server dies during a call (a stdio process that exits, an HTTP connection that breaks): the call raises
  ``ToolServerLost``, and the episode is errored (``error_kind`` ``tool_server``, left out of the loss and
  counted against ``rollout.max_error_rate``): the state it built in the server is gone. The next call starts
  the server again (reconnects, over HTTP), at most ``env.mcp_restarts`` times in a run; past that every call
  is ``ToolServerLost`` and the run stops on its error rate;
- a server that cannot start, or does not answer within ``START_TIMEOUT_S``: ``McpError`` before the first
  episode, with the end of what it wrote to stderr (kept in a temporary file, removed at the end).

``close_hubs`` shuts every server down (closes its stdin, then terminates what is left, as the SDK does); a
rollout worker's ``close`` and the end of a run call it, and so does the interpreter's exit.

What it does not do: MCP resources, prompts, sampling, elicitation or roots (only tools); authentication for
HTTP servers; repeatable timing (a tool call's finishing time decides which episodes share the engine's next
batch, so a seeded run samples the same tokens, but its behaviour log-probs may differ in their last bits).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from ctxrl.chat.surrogates import replace_surrogates, without_surrogates
from ctxrl.sections import EnvConfig
from ctxrl.tools.base import Tool, ToolServerLost, object_schema_problems
from ctxrl.tools.builtin import parse_names
from ctxrl.tools.mcp_content import clean_schema, exposed_name, result_text
from ctxrl.tools.mcp_session import (  # noqa: F401 - McpError and parse_server: this module's API too
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    McpError,
    ServerSession,
    parse_server,
)

log = logging.getLogger(__name__)

EXTRA_HINT = "pip install -e '.[mcp]'"


def hub_key(env: EnvConfig) -> tuple:
    """What tells one run's servers from another's (a hub per distinct key): ``EnvConfig`` holds a list, so it is not
    itself a key."""
    return tuple(env.mcp_servers), env.mcp_tools, env.mcp_timeout_s, env.mcp_restarts


def require_mcp() -> None:
    """An ``McpError`` naming the extra when the ``mcp`` package is not installed."""
    if importlib.util.find_spec("mcp") is None:
        raise McpError(f"env.mcp_servers needs the mcp package, which is not installed: {EXTRA_HINT}")


class McpHub:
    """The servers of one run's ``[env]`` section (``env.mcp_*``), their tools, and the thread their sessions live in
    (module docstring).

    ``tools()`` starts the servers the first time; ``sources`` says where each tool came from
    (``name -> (server, the tool's own name)``); ``close()`` shuts them down.
    """

    def __init__(self, env: EnvConfig) -> None:
        require_mcp()
        self.env = env
        self.entries = [parse_server(text) for text in env.mcp_servers]
        self.sources: dict[str, tuple[str, str]] = {}
        self.closed = False
        self._tools: list[Tool] | None = None
        self._servers: list[ServerSession] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._logs = ""
        self._lock = threading.Lock()

    def tools(self) -> list[Tool]:
        """The servers' tools, in the order of ``env.mcp_servers`` and of each server's listing."""
        with self._lock:
            if self.closed:
                raise McpError("the MCP servers of this run were shut down; a new run starts them again")
            if self._tools is None:
                self._tools = self._start()
            return list(self._tools)

    def _start(self) -> list[Tool]:
        self._logs = tempfile.mkdtemp(prefix="ctxrl-mcp-")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ctxrl-mcp", daemon=True)
        self._thread.start()
        self._servers = [ServerSession(entry, f"env.mcp_servers[{i}] ({entry.text!r})", Path(self._logs) / f"{i}.log",
                                 self.env.mcp_restarts) for i, entry in enumerate(self.entries)]
        try:
            # (each server: START_TIMEOUT_S to connect, then as long to list its tools)
            listings = self._wait(_gather(s.start() for s in self._servers), 2 * START_TIMEOUT_S + 10)
            return self._make_tools(listings)
        except BaseException:
            self._shutdown()
            raise

    def _wait(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _make_tools(self, listings: list[list[Any]]) -> list[Tool]:
        wanted = parse_names(self.env.mcp_tools)
        tools: list[Tool] = []
        self.sources = {}
        for server, listing in zip(self._servers, listings):
            for listed in listing:
                name = exposed_name(listed.name)
                if wanted and name not in wanted and listed.name not in wanted:
                    continue
                if name in self.sources:
                    raise McpError(f"two MCP tools are named {name!r}: one of {self.sources[name][0]} and one of "
                                   f"{server.label}; leave one out with env.mcp_tools, or rename it in its server")
                self.sources[name] = (server.label, listed.name)
                tools.append(self._tool(server, listed, name))
        offered = set(self.sources) | {own for _, own in self.sources.values()}
        missing = [w for w in wanted if w not in offered]
        if missing:
            every = sorted(exposed_name(t.name) for listing in listings for t in listing)
            raise McpError(f"env.mcp_tools names {', '.join(missing)}, which no MCP server offers; they offer "
                           f"{', '.join(every) or 'no tools'}")
        return tools

    def _tool(self, server: ServerSession, listed: Any, name: str) -> Tool:
        """``listed`` as a ``Tool``; an ``McpError`` naming the server and the tool when its input schema is not a
        JSON Schema of an object (checked with ``jsonschema``, which the ``mcp`` package depends on)."""
        schema = without_surrogates(clean_schema(listed.input_schema))
        problem = schema_problem(schema)
        if problem:
            raise McpError(f"{server.label} lists tool {listed.name!r} with an invalid input schema: {problem}; fix "
                           "the schema in the server, or leave the tool out with env.mcp_tools")
        description = replace_surrogates(listed.description or getattr(listed, "title", None) or "")
        return self._callable(server, listed, name, description, schema)

    def _callable(self, server: ServerSession, listed: Any, name: str, description: str, schema: dict) -> Tool:
        async def on_hub(coroutine: Any) -> Any:
            loop = self._loop
            if self.closed or loop is None or loop.is_closed():
                coroutine.close()
                raise ToolServerLost(f"the MCP servers were shut down before a call to {name}")
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, loop))

        async def ready() -> None:  # (a server being started again: before the call's deadline starts)
            await on_hub(server.live(listed.name))

        async def call(**arguments: Any) -> str:
            return result_text(await on_hub(server.call(listed.name, arguments)))

        return Tool(name=name, description=description, parameters=schema, fn=call, timeout_s=self.env.mcp_timeout_s,
                    checks_arguments=True, ready=ready)

    def restarts(self) -> list[int]:
        """How many times each server was started again after it died."""
        return [server.restarts for server in self._servers]

    def close(self) -> None:
        """Shut every server down (safe to call more than once)."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._shutdown()

    def _shutdown(self) -> None:
        if self._loop is None:
            return
        try:
            self._wait(_gather(s.close() for s in self._servers), 2 * STOP_TIMEOUT_S + 5)
        except Exception as exc:  # noqa: BLE001 - shutting down: say so, and go on
            log.warning("MCP servers did not all stop cleanly: %s: %s", type(exc).__name__, exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_TIMEOUT_S)
        if not self._loop.is_running():
            self._loop.close()
        self._loop = None
        shutil.rmtree(self._logs, ignore_errors=True)


def schema_problem(schema: Any) -> str:
    """What keeps ``schema`` from being a tool's input schema ("" for nothing): it breaks JSON Schema itself (its
    metaschema, as ``jsonschema`` checks it), or it does not describe an object with ``properties`` a dict."""
    from jsonschema import SchemaError, validators

    problems = object_schema_problems(schema)
    if problems:
        return "; ".join(problems)
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "the schema"
        return f"{where}: {exc.message}"[:300]
    return ""


async def _gather(coroutines: Any) -> list[Any]:
    return await asyncio.gather(*coroutines)


_HUBS: dict[tuple, McpHub] = {}
_HUBS_LOCK = threading.Lock()


def mcp_hub(env: EnvConfig) -> McpHub:
    """This process's hub for the servers of ``env`` (one per distinct ``hub_key``; a closed one is replaced)."""
    with _HUBS_LOCK:
        hub = _HUBS.get(hub_key(env))
        if hub is None or hub.closed:
            hub = _HUBS[hub_key(env)] = McpHub(env)
        return hub


def close_hub(env: EnvConfig) -> None:
    """Shut down the servers of ``env`` in this process, if they were started."""
    with _HUBS_LOCK:
        hub = _HUBS.pop(hub_key(env), None)
    if hub is not None:
        hub.close()


def close_hubs() -> None:
    """Shut down every MCP server this process started or connected to."""
    with _HUBS_LOCK:
        hubs = list(_HUBS.values())
        _HUBS.clear()
    for hub in hubs:
        hub.close()


atexit.register(close_hubs)
