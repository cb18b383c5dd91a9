"""MCP tool servers as ctxrl tools (``env.mcp_servers``; docs/mcp.md).

Each entry of ``env.mcp_servers`` is one server: the URL of a streamable-HTTP server
(``http://127.0.0.1:8000/mcp``) or a command line that starts one speaking MCP over stdio (``python
my_server.py --db x``). Leading ``NAME=value`` words set variables in the server's environment, as in a
shell; otherwise it gets the MCP SDK's safe subset of ours (``HOME``, ``PATH``, ...). A command whose program
is ``python`` or ``python3`` runs with the interpreter that runs ctxrl, so a server written with the ``mcp``
package finds it without an activated virtual environment. ``McpHub`` starts or connects to every server,
lists their tools (all of them, or the ones ``env.mcp_tools`` names), and makes each a ``Tool`` whose schema
is the server's input schema (``ctxrl.tools.mcp_content``); calling it sends ``tools/call``.

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
import re
import shlex
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ctxrl.errors import CtxrlError
from ctxrl.plain import PlainData
from ctxrl.tools.base import Tool, ToolServerLost
from ctxrl.tools.builtin import parse_names
from ctxrl.tools.mcp_content import clean_schema, exposed_name, result_text

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
"""How long a server may take to start and list its tools (importing the ``mcp`` package alone takes a second)."""
STOP_TIMEOUT_S = 10.0
"""How long shutting one server down may take before it is abandoned (the SDK kills a stdio server within 4 s)."""
STDERR_TAIL = 800
"""Characters of a server's stderr quoted in an error."""
EXTRA_HINT = "pip install -e '.[mcp]'"

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class McpError(CtxrlError, RuntimeError):
    """An MCP server that cannot be started, reached or used as configured."""

    kind = "MCP error"


@dataclass(frozen=True)
class McpSettings(PlainData):
    """The servers of a run and how their tools are called (``env.mcp_*``)."""

    servers: tuple[str, ...] = ()
    tools: str = ""
    """Comma-separated names of the servers' tools to offer; empty: every tool they list."""
    timeout_s: float = 30.0
    restarts: int = 3

    @classmethod
    def from_config(cls, config: Any) -> McpSettings:
        e = config.env
        return cls(servers=tuple(e.mcp_servers), tools=e.mcp_tools, timeout_s=e.mcp_timeout_s,
                   restarts=e.mcp_restarts)


@dataclass(frozen=True)
class ServerEntry:
    """One parsed entry of ``env.mcp_servers``: a URL, or a program's argv with variables to set."""

    text: str
    url: str = ""
    argv: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def parse_server(text: str) -> ServerEntry:
    """An entry of ``env.mcp_servers`` (see the module docstring); a ``ValueError`` naming the problem and the fix."""
    entry = text.strip()
    if not entry:
        raise ValueError("an empty entry; give a command line (python my_server.py) or a URL (http://HOST:PORT/mcp)")
    if _URL.match(entry):
        parts = urlsplit(entry)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{entry!r} is not an http(s) URL with a host; an MCP server is reached over "
                             "streamable HTTP (http://HOST:PORT/mcp) or started from a command line")
        return ServerEntry(entry, url=entry)
    try:
        words = shlex.split(entry)
    except ValueError as exc:
        raise ValueError(f"{entry!r} is not a command line ({exc}); quote it as a shell would") from None
    env = []
    while words and _ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env.append((name, value))
    if not words:
        raise ValueError(f"{entry!r} sets variables but names no command to run")
    if words[0] in ("python", "python3"):
        words[0] = sys.executable
    elif shutil.which(words[0]) is None:
        raise ValueError(f"{entry!r}: no program {words[0]!r} on PATH, nor an executable file of that name; give "
                         "the program's path")
    return ServerEntry(entry, argv=tuple(words), env=tuple(env))


def require_mcp() -> None:
    """An ``McpError`` naming the extra when the ``mcp`` package is not installed."""
    if importlib.util.find_spec("mcp") is None:
        raise McpError(f"env.mcp_servers needs the mcp package, which is not installed: {EXTRA_HINT}")


class McpHub:
    """The servers of one ``McpSettings``, their tools, and the thread their sessions live in (module docstring).

    ``tools()`` starts the servers the first time; ``sources`` says where each tool came from
    (``name -> (server, the tool's own name)``); ``close()`` shuts them down.
    """

    def __init__(self, settings: McpSettings) -> None:
        require_mcp()
        self.settings = settings
        self.entries = [parse_server(text) for text in settings.servers]
        self.sources: dict[str, tuple[str, str]] = {}
        self.closed = False
        self._tools: list[Tool] | None = None
        self._servers: list[_Server] = []
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
        self._servers = [_Server(entry, f"env.mcp_servers[{i}] ({entry.text!r})", Path(self._logs) / f"{i}.log",
                                 self.settings.restarts) for i, entry in enumerate(self.entries)]
        try:
            listings = self._wait(_gather(s.start() for s in self._servers), START_TIMEOUT_S + 10)
            return self._make_tools(listings)
        except BaseException:
            self._shutdown()
            raise

    def _wait(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _make_tools(self, listings: list[list[Any]]) -> list[Tool]:
        wanted = parse_names(self.settings.tools)
        tools: list[Tool] = []
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

    def _tool(self, server: _Server, listed: Any, name: str) -> Tool:
        async def on_hub(coroutine: Any) -> Any:
            if self.closed:
                coroutine.close()
                raise ToolServerLost(f"the MCP servers were shut down before a call to {name}")
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

        async def ready() -> None:  # (a server being started again: before the call's deadline starts)
            await on_hub(server.live(listed.name))

        async def call(**arguments: Any) -> str:
            return result_text(await on_hub(server.call(listed.name, arguments)))

        return Tool(name=name, description=listed.description or getattr(listed, "title", None) or "",
                    parameters=clean_schema(listed.input_schema), fn=call, timeout_s=self.settings.timeout_s,
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
            self._wait(_gather(s.stop() for s in self._servers), STOP_TIMEOUT_S + 5)
        except Exception as exc:  # noqa: BLE001 - shutting down: say so, and go on
            log.warning("MCP servers did not all stop cleanly: %s: %s", type(exc).__name__, exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_TIMEOUT_S)
        if not self._loop.is_running():
            self._loop.close()
        self._loop = None
        shutil.rmtree(self._logs, ignore_errors=True)


class _Server:
    """One server's session, on the hub's loop: started by a task that holds it open until ``stop``."""

    def __init__(self, entry: ServerEntry, label: str, log_path: Path, max_restarts: int) -> None:
        self.entry, self.label, self.log_path, self.max_restarts = entry, label, log_path, max_restarts
        self.client: Any = None
        self.restarts = 0
        self.failure = ""
        self._task: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._restart: asyncio.Task | None = None

    async def start(self) -> list[Any]:
        """Start (or connect to) the server and list its tools; ``McpError`` with its stderr when it cannot."""
        ready = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._serve(ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), START_TIMEOUT_S)
            return await asyncio.wait_for(self._listing(), START_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            await self.stop()
            raise McpError(f"{self.label} did not answer within {START_TIMEOUT_S:g} s{self.stderr_tail()}") from None
        except McpError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the SDK raised, named with what the server said
            await self.stop()
            raise McpError(f"{self.label} could not be started: {describe(exc)}{self.stderr_tail()}") from None

    async def _serve(self, ready: asyncio.Future) -> None:
        from mcp import Client

        errlog = None
        try:
            if self.entry.url:
                transport: Any = self.entry.url
            else:
                from mcp.client.stdio import StdioServerParameters, stdio_client

                errlog = self.log_path.open("w", encoding="utf-8", errors="replace")  # (this start's stderr only)
                params = StdioServerParameters(command=self.entry.argv[0], args=list(self.entry.argv[1:]),
                                               env=dict(self.entry.env) or None)
                transport = stdio_client(params, errlog=errlog)
            async with Client(transport) as client:
                self.client = client
                ready.set_result(None)
                await self._stop.wait()
        except Exception as exc:  # noqa: BLE001 - kept: a server that failed to start, or died
            self.failure = describe(exc)
            if not ready.done():
                ready.set_exception(exc)
        finally:
            self.client = None
            if errlog is not None:
                errlog.close()

    async def _listing(self) -> list[Any]:
        tools, cursor = [], None
        for _ in range(1000):  # (a server whose pages never end cannot hang the start)
            page = await self.client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """``tools/call`` on the live session (started again if it died before); ``ToolServerLost`` if it dies now."""
        client = await self.live(name)
        try:
            return await client.call_tool(name, arguments)
        except Exception as exc:
            if not self._lost(exc, client):
                raise
            restarting = self.restarts < self.max_restarts
            if self.client is client or self.client is None:  # (not a session another call already replaced)
                self.failure = describe(exc)
                self._after_death()
            raise ToolServerLost(f"MCP server {self.label} died during a call to {name} ({describe(exc)})"
                                 f"{self.stderr_tail()}; " + ("it is being started again for the next calls"
                                 if restarting else "no restarts are left (env.mcp_restarts)")) from None

    def _lost(self, exc: Exception, client: Any) -> bool:
        """Whether ``exc`` means the session is gone (the connection closed), not an answer from the server."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        if isinstance(exc, MCPError):
            return exc.error.code == CONNECTION_CLOSED
        return self.client is not client or not self._alive()

    def _alive(self) -> bool:
        return self.client is not None and self._task is not None and not self._task.done()

    async def live(self, name: str) -> Any:
        """The live session: after waiting for a restart under way, or starting one for a server found dead;
        ``ToolServerLost`` when it is down for good (``name``: the tool a call waits for)."""
        for _ in range(2):
            if self._restart is not None and not self._restart.done():
                await asyncio.shield(self._restart)  # (a call past its deadline does not stop the restart)
            if self._alive():
                return self.client
            if self.restarts >= self.max_restarts:
                raise ToolServerLost(f"MCP server {self.label} is down ({self.failure or 'stopped'}) and was started "
                                     f"again {self.restarts} times already (env.mcp_restarts = {self.max_restarts}); "
                                     f"no call to {name} can run")
            self._after_death()  # it died between calls (an HTTP session that ended)
        raise ToolServerLost(f"MCP server {self.label} died and could not be started again: {self.failure}")

    def _after_death(self) -> None:
        """Stop the dead session, and start the server again unless the restarts are spent, in a task of its own
        (a call that waits for it and passes its deadline does not stop it); unless that is under way already."""
        if self._restart is None or self._restart.done():
            self._restart = asyncio.ensure_future(self._restarted())

    async def _restarted(self) -> None:
        await self.stop()
        if self.restarts >= self.max_restarts:
            return
        self.restarts += 1
        log.warning("MCP server %s is down (%s): starting it again (%d of at most %d)", self.label,
                    self.failure or "stopped", self.restarts, self.max_restarts)
        try:
            await self.start()
        except McpError as exc:
            self.failure = str(exc)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._stop.set()
        done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
        if not done:
            task.cancel()
            log.warning("MCP server %s did not stop within %g s; abandoned", self.label, STOP_TIMEOUT_S)

    def stderr_tail(self) -> str:
        """``; it wrote to stderr: A | B | C`` (its last lines since it started), or nothing for a silent or HTTP
        server."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            return ""
        tail = " | ".join(lines[-6:])
        cut = "..." if len(tail) > STDERR_TAIL or len(lines) > 6 else ""
        return f"; it wrote to stderr: {cut}{tail[-STDERR_TAIL:]}"


async def _gather(coroutines: Any) -> list[Any]:
    return await asyncio.gather(*coroutines)


def describe(exc: BaseException) -> str:
    """An exception as one line, an exception group as its first leaf (the SDK's task groups wrap the cause)."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_HUBS: dict[McpSettings, McpHub] = {}
_HUBS_LOCK = threading.Lock()


def mcp_hub(settings: McpSettings) -> McpHub:
    """This process's hub for ``settings`` (one per distinct settings; a closed one is replaced)."""
    with _HUBS_LOCK:
        hub = _HUBS.get(settings)
        if hub is None or hub.closed:
            hub = _HUBS[settings] = McpHub(settings)
        return hub


def close_hub(settings: McpSettings) -> None:
    """Shut down the servers of ``settings`` in this process, if they were started."""
    with _HUBS_LOCK:
        hub = _HUBS.pop(settings, None)
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
