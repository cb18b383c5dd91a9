"""What one client may cost ``ctxrl serve``: who may call, the body's size and read time, a slot, its share of the
render thread, the errors kept.

- ``Guard`` (ASGI middleware, outermost of the app's own): on a connection to a loopback address, the
  ``Host`` and ``Origin`` headers must name a loopback host or one configured (``allowed_hosts``,
  ``allowed_origins``), checked by the MCP SDK's own DNS-rebinding check, the one ``ctxrl mcp-serve``
  runs: a web page whose name an attacker points at 127.0.0.1 sends its own name as ``Host`` (421), and
  a page that posts to ``http://127.0.0.1:PORT`` sends its own ``Origin`` (403), so neither reads an
  episode or posts a reward; then the API key on every route, compared in constant time; a declared
  ``Content-Length`` over the limit is a 413 before anything is read; and any error inside ctxrl becomes
  a 500 with OpenAI's body, counted, *without* being raised on to the server, which would log it and
  reset the keep-alive connection it came on.
- ``RenderQueue``: the one thread that renders, tokenises and decodes takes its work from each client's
  own queue in turn (a client: one connection), and a client may have ``per_client`` renders waiting
  or running (more: 429). Two clients sending huge messages delay another client's call by at most one
  render each, never by all of theirs.
- ``read_body``: the body as it streams in (chunked too), refused with 413 as soon as it passes
  the limit, never buffered whole first, and with 408 when it has not all arrived within the read
  deadline. A request takes a work slot (``Slots``, 429 when none is free) only once its body is
  read, so slow clients hold a connection and a coroutine, never the slots other clients need;
  ``/health`` takes none at all.
- ``ErrorLog``: errors answered, counted by status and code, and the last few as short text. No
  exception object is kept (its traceback would hold the request that raised it), so memory does
  not grow with bad requests. An engine failure is kept once, as text, for a trainer to stop on.

Not here: the Host check of a server bound to another address (a request that arrives on one is not
checked, as the MCP SDK checks none on such a server: give it an API key), a deadline on the request
line and headers (uvicorn reads them; put a proxy in front of a server open to the internet), and a
cap on open connections (uvicorn's ``limit_concurrency``).
After a 413 the server still reads and discards what the client goes on sending, so that the
client can read the answer and reuse its connection (uvicorn does this).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from starlette.requests import ClientDisconnect, Request

from ctxrl.errors import ConfigError
from ctxrl.serve.protocol import APIError

RECENT_ERRORS = 16
"""How many errors ``ErrorLog.recent`` keeps, newest last."""
MESSAGE_CHARS = 300
"""How much of an error's message ``ErrorLog.recent`` keeps (a message can quote what the client sent)."""


class ErrorLog:
    """Errors answered: ``counts`` by ``"status code"``, the ``recent`` few as short dicts, the first engine
    failure as text (``engine_failure``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.recent: deque[dict] = deque(maxlen=RECENT_ERRORS)
        self.engine_failure: str | None = None

    def record(self, error: APIError) -> None:
        self.counts[f"{error.status} {error.code or error.type}"] += 1
        message = error.message if len(error.message) <= MESSAGE_CHARS else error.message[:MESSAGE_CHARS] + "..."
        self.recent.append({"time": round(time.time(), 3), "status": error.status, "code": error.code,
                            "param": error.param, "message": message})

    def engine_failed(self, exc: BaseException) -> None:
        """Keep the first engine failure's traceback, as text (``Server.raise_internal`` raises it for a trainer)."""
        if self.engine_failure is None:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.engine_failure = text[-4000:]

    def summary(self) -> dict:
        return {"total": sum(self.counts.values()), "counts": dict(self.counts), "recent": list(self.recent)}


class Slots:
    """At most ``limit`` requests doing work (rendering, sampling) at once; past it, 429."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_use = limit, 0

    @contextmanager
    def take(self):
        if self.in_use >= self.limit:
            raise APIError(429, f"{self.limit} requests are in flight; retry shortly", type="rate_limit_error",
                           code="too_many_requests")
        self.in_use += 1
        try:
            yield
        finally:
            self.in_use -= 1


def too_large(size: int | str, limit: int) -> APIError:
    return APIError(413, f"the body is {size} bytes; the limit is {limit}", code="request_too_large")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, read as it arrives: 413 once it passes ``limit`` bytes, 408 when it is not all in within
    ``timeout_s`` of the request's start (whatever ``Content-Length`` said, and for chunked bodies too)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    body = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return bytes(body)
        except (TimeoutError, asyncio.TimeoutError):
            raise APIError(408, f"the body did not arrive within {timeout_s:g} s (it had {len(body)} bytes)",
                           code="request_timeout") from None
        except ClientDisconnect:
            raise APIError(400, "the client closed the connection before sending the whole body",
                           code="client_disconnected") from None
        body += chunk
        if len(body) > limit:
            raise too_large(f"over {limit}", limit)


class RenderQueue:
    """One worker thread running each client's work in turn, at most ``per_client`` jobs a client (module docstring).

    ``submit(client, fn)`` returns a ``concurrent.futures.Future`` of ``fn()``, or raises a 429 ``APIError`` when
    ``client`` has ``per_client`` jobs waiting or running already."""

    def __init__(self, per_client: int = 4, name: str = "ctxrl-serve-render") -> None:
        self.per_client = per_client
        self.waiting: dict[Hashable, deque[tuple[Callable[[], Any], Future]]] = {}
        self.jobs: Counter[Hashable] = Counter()
        """Jobs a client has waiting or running."""
        self.turns: deque[Hashable] = deque()
        """Clients with work waiting, in the order they get the thread."""
        self.ready = threading.Condition()
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def submit(self, client: Hashable, fn: Callable[[], Any], limit: int | None = None) -> Future:
        """``fn()`` in ``client``'s turn; ``limit``: its jobs at once (default ``per_client``), past it a 429."""
        future: Future = Future()
        limit = self.per_client if limit is None else limit
        with self.ready:
            if self.jobs[client] >= limit:
                raise APIError(429, f"this client has {limit} requests being rendered already; wait for "
                                    "their answers", type="rate_limit_error", code="too_many_requests")
            self.jobs[client] += 1
            if client not in self.waiting:
                self.turns.append(client)
            self.waiting.setdefault(client, deque()).append((fn, future))
            self.ready.notify()
        return future

    def _next(self) -> tuple[Hashable, Callable[[], Any], Future]:
        with self.ready:
            while not self.turns:
                self.ready.wait()
            client = self.turns.popleft()
            fn, future = self.waiting[client].popleft()
            if self.waiting[client]:
                self.turns.append(client)  # (its next job waits for every other client's turn)
            else:
                del self.waiting[client]
            return client, fn, future

    def _work(self) -> None:
        while True:
            client, fn, future = self._next()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - the caller's to raise
                        future.set_exception(exc)
            finally:
                with self.ready:
                    self.jobs[client] -= 1
                    if not self.jobs[client]:
                        del self.jobs[client]


LOOPBACK_HOSTS = ("127.0.0.1", "127.0.0.1:*", "localhost", "localhost:*", "[::1]", "[::1]:*")
LOOPBACK_ORIGINS = ("http://127.0.0.1", "http://127.0.0.1:*", "http://localhost", "http://localhost:*",
                    "http://[::1]", "http://[::1]:*")
"""What a request that comes in on a loopback address may name as its ``Host`` and ``Origin`` (besides the
configured ones): the MCP SDK's loopback defaults, and the same names without a port."""


def host_check(allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()) -> Any:
    """The MCP SDK's DNS-rebinding check (``TransportSecurityMiddleware``, which ``ctxrl mcp-serve`` runs too) for
    the loopback names and these (exact, or ``name:*`` for any port); a ``ConfigError`` without the ``mcp`` package."""
    try:
        from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
    except ImportError:
        raise ConfigError("ctxrl serve checks Host and Origin with the mcp package's DNS-rebinding check, and mcp is "
                          "not installed: pip install -e '.[serve]'") from None

    return TransportSecurityMiddleware(TransportSecuritySettings(
        allowed_hosts=[*LOOPBACK_HOSTS, *allowed_hosts], allowed_origins=[*LOOPBACK_ORIGINS, *allowed_origins]))


def on_loopback(scope: dict) -> bool:
    """Whether the request came in on a loopback address (a unix socket counts; an in-process ASGI transport, whose
    "server" is a name, does not: no browser reaches it)."""
    server = scope.get("server")
    if server is None:
        return True
    try:
        return ipaddress.ip_address(server[0]).is_loopback
    except ValueError:
        return False


REFUSED = {421: ("Host", "invalid_host", "allowed_hosts"), 403: ("Origin", "invalid_origin", "allowed_origins")}


class Guard:
    """ASGI middleware: Host and Origin (421, 403), the key (401), a declared body over the limit (413), and errors
    inside ctxrl (500)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, errors: ErrorLog, hosts: Any) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes, self.errors = max_body_bytes, errors
        self.hosts = hosts
        """``host_check``'s check."""

    async def refused_host(self, scope) -> APIError | None:
        """A 421 or 403 naming the header, when a request on a loopback address names a host it may not."""
        if not on_loopback(scope):
            return None
        response = await self.hosts.validate_request(Request(scope))
        if response is None:
            return None
        header, code, setting = REFUSED[response.status_code]
        value = Request(scope).headers.get(header.lower(), "")
        return APIError(response.status_code, f"the {header} header {value[:100]!r} names neither this machine nor "
                                              f"a host the server allows ({setting}): a web page is not let in "
                                              "under another name (DNS rebinding)", type="permission_error",
                        code=code)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = await self.refused_host(scope)
        if refused is not None:
            return await self.refuse(send, refused)
        headers = dict(scope["headers"])  # (the last of a repeated header: the key must be the one sent)
        # (OpenAI's clients send Authorization: Bearer KEY; Anthropic's x-api-key: KEY, read as the same)
        anthropic_key = headers.get(b"x-api-key")
        given = headers.get(b"authorization") or (b"Bearer " + anthropic_key if anthropic_key is not None else b"")
        if self.expected is not None and not hmac.compare_digest(given, self.expected):
            return await self.refuse(send, APIError(401, "missing or wrong API key (Authorization: Bearer <key>, "
                                                         "or x-api-key: <key>)",
                                                    type="authentication_error", code="invalid_api_key"))
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await self.refuse(send, too_large(int(length), self.max_body_bytes))
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - an error inside ctxrl: a 500, counted, and the server goes on
            error = APIError(500, f"internal error in ctxrl: {type(exc).__name__}: {exc}"[:MESSAGE_CHARS],
                             type="server_error", code="internal_error")
            if not started:
                await self.refuse(send, error)
            else:
                self.errors.record(error)

    async def refuse(self, send, error: APIError) -> None:
        self.errors.record(error)
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
