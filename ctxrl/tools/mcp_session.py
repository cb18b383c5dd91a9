"""One MCP server: its entry in ``env.mcp_servers``, parsed, and its session (``ServerSession``).

A stdio server is started through ``ctxrl.tools.mcp_reaper`` (on Linux), in a session of its own as the SDK
starts it: when the server exits or is stopped, every process under it ends too, those in a session or process
group of their own included. A session lives on the hub's event loop (``ctxrl.tools.mcp``): a task opens it
(starting the process, for a command line) and holds it open until ``stop``, because the SDK's transports must be
closed by the task that opened them. ``call`` sends ``tools/call``; when the session turns out to be gone (the
connection closed), the call raises ``ToolServerLost`` and the server is started again in a task of its own
(``restart``), which later calls wait for (``live``) before their deadline starts. A stdio server's stderr goes to
a file, whose last lines errors quote.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ctxrl.errors import CtxrlError
from ctxrl.tools.base import ToolServerLost

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
RESTART_DELAYS_S = (0.5, 1.0, 2.0, 4.0)
"""The waits between a restart's tries to start a server again (one restart: all of them, 7.5 s in all)."""
"""How long a server may take to start and list its tools (importing the ``mcp`` package alone takes a second)."""
STOP_TIMEOUT_S = 10.0
"""How long shutting one server down may take before it is abandoned (the SDK kills a stdio server within 4 s)."""
STDERR_TAIL = 800
"""Characters of a server's stderr quoted in an error."""

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class McpError(CtxrlError, RuntimeError):
    """An MCP server that cannot be started, reached or used as configured."""

    kind = "MCP error"


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


class ServerSession:
    """One server's session, on the hub's loop: started by a task that holds it open until ``stop``."""

    def __init__(self, entry: ServerEntry, label: str, log_path: Path, max_restarts: int) -> None:
        self.entry, self.label, self.log_path, self.max_restarts = entry, label, log_path, max_restarts
        self.client: Any = None
        self.restarts = 0
        self.failure = ""
        self.listed: list[str] | None = None
        """The names of the tools it listed when it first started."""
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
            listing = await asyncio.wait_for(self._listing(), START_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            await self.stop()
            raise McpError(f"{self.label} did not answer within {START_TIMEOUT_S:g} s{self.stderr_tail()}") from None
        except Exception as exc:  # noqa: BLE001 - whatever the SDK raised, named with what the server said
            await self.stop()
            raise McpError(f"{self.label} could not be started: {describe(exc)}{self.stderr_tail()}") from None
        if self.listed is None:
            self.listed = sorted(t.name for t in listing)
        return listing

    async def _serve(self, ready: asyncio.Future) -> None:
        from mcp import Client

        errlog = None
        try:
            if self.entry.url:
                transport: Any = self.entry.url
            else:
                from mcp.client.stdio import StdioServerParameters, stdio_client

                errlog = self.log_path.open("w", encoding="utf-8", errors="replace")  # (this start's stderr only)
                argv = supervised(self.entry.argv)
                params = StdioServerParameters(command=argv[0], args=list(argv[1:]), env=dict(self.entry.env) or None)
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
        ``ToolServerLost`` when it is down (``name``: the tool a call waits for). One call spends at most one
        restart; a restart tries to reconnect for a few seconds (``RESTART_DELAYS_S``) before it gives up."""
        if self._alive() and (self._restart is None or self._restart.done()):
            return self.client
        if self._restart is None or self._restart.done():
            if self.restarts >= self.max_restarts:
                raise ToolServerLost(f"MCP server {self.label} is down ({self.failure or 'stopped'}) and was started "
                                     f"again {self.restarts} times already (env.mcp_restarts = {self.max_restarts}); "
                                     f"no call to {name} can run")
            self._after_death()  # it died between calls (an HTTP session that ended)
        await asyncio.shield(self._restart)  # (a call past its deadline does not stop the restart)
        if self._alive():
            return self.client
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
        for delay in (0.0, *RESTART_DELAYS_S):  # (a server being redeployed is back within seconds)
            await asyncio.sleep(delay)
            try:
                listing = await self.start()
                break
            except McpError as exc:
                self.failure = str(exc)
        else:
            return
        if sorted(t.name for t in listing) != self.listed:  # (the policy keeps the tools it was shown)
            log.warning("MCP server %s lists other tools since it was started again: %s (the run offers %s)",
                        self.label, ", ".join(sorted(t.name for t in listing)), ", ".join(self.listed))

    async def close(self) -> None:
        """Stop for good: a restart under way is cancelled first, and none follows."""
        self.max_restarts = self.restarts
        if self._restart is not None and not self._restart.done():
            self._restart.cancel()
            await asyncio.wait({self._restart}, timeout=STOP_TIMEOUT_S)
        await self.stop()

    async def stop(self) -> None:
        """End the session and its process; the task is forgotten only once it is done (a ``stop`` cancelled while
        it waits, as ``close`` cancels a restart, leaves it for the next ``stop`` to wait for)."""
        task = self._task
        if task is None:
            return
        self._stop.set()
        done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
        if self._task is task:
            self._task = None
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


REAPER = Path(__file__).with_name("mcp_reaper.py")
_said_no_reaper: list[bool] = []


def supervised(argv: tuple[str, ...]) -> tuple[str, ...]:
    """``argv`` started through ``mcp_reaper`` (on Linux), so that every process the server starts, in its group or
    in a session of its own, ends when it does; elsewhere ``argv`` itself, said once."""
    if sys.platform.startswith("linux"):
        return (sys.executable, "-I", "-S", str(REAPER), "--", *argv)
    if not _said_no_reaper:
        _said_no_reaper.append(True)
        log.warning("MCP servers are started without ctxrl's reaper on %s: processes a server starts in a session of "
                    "its own may outlive it (the SDK ends its process group)", sys.platform)
    return argv


def describe(exc: BaseException) -> str:
    """An exception as one line, an exception group as its first leaf (the SDK's task groups wrap the cause)."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
