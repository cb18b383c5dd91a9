"""``guarded_compile`` from several threads: while one thread compiles, a compiled call from another must wait, as
dynamo's tracing flag is the whole process's (a stand-in for ``torch.compile`` with that rule, so the test needs no
compiler), and a failed compilation falls back to the eager function once."""

from __future__ import annotations

import threading
import time

import pytest

from ctxrl.models import fused


class TracingStandIn:
    """``torch.compile`` as far as threads are concerned: the first call of each compiled function "traces" for a
    while, and any compiled call made while some trace is running raises dynamo's error."""

    def __init__(self) -> None:
        self.tracing = 0
        self.calls = 0

    def compile(self, fn, **_):
        traced = {"done": False}

        def compiled(*args):
            if self.tracing:
                raise RuntimeError("Detected that you are using FX to symbolically trace a dynamo-optimized "
                                   "function. This is not supported at the moment.")
            self.calls += 1
            if not traced["done"]:
                self.tracing += 1
                time.sleep(0.2)  # compiling
                self.tracing -= 1
                traced["done"] = True
            return fn(*args)

        return compiled


@pytest.fixture
def stand_in(monkeypatch):
    compiler = TracingStandIn()
    monkeypatch.setattr(fused.torch, "compile", compiler.compile)
    return compiler


def test_compiled_calls_from_two_threads_take_turns_while_one_compiles(stand_in):
    slow = fused.guarded_compile(lambda x: x + 1, "slow")
    fast = fused.guarded_compile(lambda x: x * 2, "fast")
    fast(1)  # compiled already, as a decode step's function would be
    errors, results = [], []

    def hammer():
        try:
            for _ in range(50):
                results.append(fast(3))
                time.sleep(0.005)
        except Exception as exc:  # noqa: BLE001 - what the test looks for
            errors.append(exc)

    other = threading.Thread(target=hammer)
    other.start()
    time.sleep(0.02)
    assert slow(1) == 2  # compiles (0.2 s) while the other thread keeps calling
    other.join()
    assert not errors and results == [6] * 50
    assert stand_in.calls == 52


def test_without_the_lock_the_same_calls_fail(stand_in, monkeypatch):
    """The stand-in reproduces the failure the lock prevents (so the test above tests something)."""
    import contextlib

    monkeypatch.setattr(fused, "COMPILED_CALLS", contextlib.nullcontext())
    slow = fused.guarded_compile(lambda x: x + 1, "slow")
    fast = fused.guarded_compile(lambda x: x * 2, "fast")
    fast(1)
    errors = []

    def call_during_trace():
        time.sleep(0.05)
        try:
            fast(3)
        except RuntimeError as exc:
            errors.append(exc)

    other = threading.Thread(target=call_during_trace)
    other.start()
    slow(1)
    other.join()
    assert errors and "symbolically trace" in str(errors[0])


def test_a_failed_compilation_falls_back_to_eager_once(monkeypatch):
    def broken(fn, **_):
        def compiled(*args):
            raise RuntimeError("no compiler here")
        return compiled

    monkeypatch.setattr(fused.torch, "compile", broken)
    failures = []
    f = fused.guarded_compile(lambda x: x - 1, "broken", on_failure=lambda: failures.append(1))
    assert [f(5), f(6)] == [4, 5] and failures == [1]
