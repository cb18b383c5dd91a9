"""What one client may cost ``ctxrl serve``: the key, the body's size and read time, a slot, the errors kept.

- ``Guard`` (ASGI middleware, outermost of the app's own): the API key on every route, compared in
  constant time; a declared ``Content-Length`` over the limit is a 413 before anything is read; and
  any error inside ctxrl becomes a 500 with OpenAI's body, counted, *without* being raised on to
  the server, which would log it and reset the keep-alive connection it came on.
- ``read_body``: the body as it streams in (chunked too), refused with 413 as soon as it passes
  the limit, never buffered whole first, and with 408 when it has not all arrived within the read
  deadline. A request takes a work slot (``Slots``, 429 when none is free) only once its body is
  read, so slow clients hold a connection and a coroutine, never the slots other clients need;
  ``/health`` takes none at all.
- ``ErrorLog``: errors answered, counted by status and code, and the last few as short text. No
  exception object is kept (its traceback would hold the request that raised it), so memory does
  not grow with bad requests. An engine failure is kept once, as text, for a trainer to stop on.

Not here: a deadline on the request line and headers (uvicorn reads them; put a proxy in front of
a server open to the internet), and a cap on open connections (uvicorn's ``limit_concurrency``).
After a 413 the server still reads and discards what the client goes on sending, so that the
client can read the answer and reuse its connection (uvicorn does this).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import traceback
from collections import Counter, deque
from contextlib import contextmanager

from starlette.requests import ClientDisconnect, Request

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


class Guard:
    """ASGI middleware: the key (401), a declared body over the limit (413), and errors inside ctxrl (500)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, errors: ErrorLog) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes, self.errors = max_body_bytes, errors

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # (the last of a repeated header: the key must be the one sent)
        if self.expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await self.refuse(send, APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
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
