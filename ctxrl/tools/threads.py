"""Run a blocking call where it can be abandoned: a daemon thread whose result the event loop awaits.

``asyncio.to_thread`` runs a call in the event loop's executor, and ``asyncio.run`` waits for every
executor thread when it closes: a tool that hangs past its timeout would then hold up the end of
the step (and a process exit) for as long as it runs. ``in_daemon_thread`` starts a daemon thread
instead. Awaiting it can be cancelled or timed out like any coroutine; the thread is then
forgotten: nothing waits for it, and the process can exit while it runs.

What this does not do: stop the call. Python threads cannot be killed, so an abandoned call keeps
running (and using a CPU) until it returns. Code that may run away belongs in a process that can
be killed at its deadline, as the sandboxed ``python`` tool does (``ctxrl.tools.sandbox``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], /, *args: Any, name: str = "ctxrl-call", **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a new daemon thread; its result (or exception) when it finishes."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop is closed: whoever asked gave up long ago
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled or timed out meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
