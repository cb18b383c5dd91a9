"""``ProcessWorker``: a ``RolloutWorker`` in a spawned subprocess, spoken to in plain data only.

The parent sends the ``RolloutSpec`` once, then weights and requests; the child builds the worker
from the spec (``RolloutWorker.from_spec``), loads the weights and plays each request. Before it
reads the spec, it imports the spec's plugins and the modules the parent's episode runners come
from (``runner_modules``), so it picks the runner an in-process worker would. What
crosses the pipe is JSON (spec, requests, episodes, errors) and safetensors bytes (weights):
never a pickle, so nothing the child sends can run code in the parent. It is the smallest
instance of the boundary every remote worker stands on (a Ray actor, a server), and the test that
the boundary holds: a subprocess plays exactly the episodes an in-process worker plays, given the
same spec, weights and request (fp32, CPU, the same number of threads).

Use: ``with ProcessWorker(spec) as worker: worker.load_weights(model.state_dict(), version=1);
episodes = worker.run(request)``. An exception in the child comes back as a ``WorkerError`` with
the child's traceback, and the worker goes on. A child that died, or that gave no answer within
``timeout_s`` (``start_timeout_s`` for building the worker: loading a model), is a ``WorkerError``
too, never a hang: the child is killed, and every later call says the worker is gone (start a new
one). Each request carries a sequence number that its reply must echo, so a reply can never be
taken for another's.
"""

from __future__ import annotations

import json
import multiprocessing
import traceback
from collections.abc import Mapping
from typing import Any

from ctxrl.rollout.spec import RolloutRequest, RolloutSpec
from ctxrl.types import Episode


class WorkerError(RuntimeError):
    """The worker process failed (its traceback is in the message) or is gone."""


class ProcessWorker:
    """Plays requests in a spawned process (see the module docstring)."""

    def __init__(self, spec: RolloutSpec, *, threads: int | None = None, timeout_s: float = 600.0,
                 start_timeout_s: float = 1800.0) -> None:
        import torch

        from ctxrl.rollout.runners import runner_modules

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._timeout_s = timeout_s
        self._version = 0
        self._sequence = 0
        self._gone: str | None = None
        self._process = context.Process(target=_serve, args=(child, json.dumps(spec.to_dict()),
                                                             threads or torch.get_num_threads(), runner_modules()),
                                        name="ctxrl-rollout-worker", daemon=True)
        self._process.start()
        child.close()
        try:
            self._call({"op": "ready"}, timeout_s=start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def policy_version(self) -> int:
        return self._version

    def load_weights(self, state: Mapping[str, Any], *, version: int, partial: bool = False) -> None:
        """Send ``state`` (tensors by name) to the worker's engine, as policy ``version`` (``partial``: only the
        tensors that changed, a LoRA run's adapters).

        Aliases (tied embeddings: ``lm_head.weight`` is ``embed_tokens.weight``) are sent once: the
        engine fills a tied tensor from the one it shares storage with.
        """
        from safetensors.torch import save

        tensors, seen = {}, set()
        for name, value in state.items():
            key = (value.data_ptr(), value.dtype, tuple(value.shape), tuple(value.stride()))
            if key in seen:
                continue
            seen.add(key)
            tensors[name] = value.detach().to("cpu").contiguous()
        payload = save(tensors)
        self._call({"op": "load_weights", "version": int(version), "partial": bool(partial)}, payload)
        self._version = int(version)

    def run(self, request: RolloutRequest) -> list[Episode]:
        """Play ``request`` in the worker process and return its episodes."""
        reply = self._call({"op": "run", "request": request.to_dict()})
        return [Episode.from_dict(e) for e in reply["episodes"]]

    def close(self) -> None:
        """Ask the child to stop (kill it if it does not within 10 s); safe to call more than once."""
        if self._process.is_alive():
            try:
                self._send({"op": "close"})
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=10)
        self._gone = self._gone or "closed"
        self._conn.close()

    def __enter__(self) -> ProcessWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        self._conn.send_bytes(json.dumps(header).encode())
        self._conn.send_bytes(payload)

    def _call(self, header: dict[str, Any], payload: bytes = b"", *, timeout_s: float | None = None) -> dict[str, Any]:
        if self._gone is not None:
            raise WorkerError(f"the rollout worker process is gone ({self._gone}); start a new ProcessWorker")
        self._sequence += 1
        header = {**header, "seq": self._sequence}
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        try:
            self._send(header, payload)
            if not self._conn.poll(timeout_s):
                self._kill(f"it gave no answer to {header['op']!r} in {timeout_s:g} s")
                raise WorkerError(f"the rollout worker process gave no answer to {header['op']!r} in {timeout_s:g} s;"
                                  " it was stopped (raise timeout_s for longer requests)")
            reply = json.loads(self._conn.recv_bytes())
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as exc:
            self._kill(f"it died while handling {header['op']!r}")
            raise WorkerError(f"the rollout worker process is gone (exit code {self._process.exitcode}); "
                              f"it failed while handling {header['op']!r}") from exc
        if reply.get("seq") != self._sequence:  # cannot happen while every timeout kills the child
            self._kill(f"reply {reply.get('seq')} to request {self._sequence}")
            raise WorkerError(f"the rollout worker process answered request {reply.get('seq')} when asked "
                              f"{self._sequence}; it was stopped")
        if "error" in reply:
            raise WorkerError(f"the rollout worker process failed on {header['op']!r}:\n{reply['error']}")
        return reply

    def _kill(self, why: str) -> None:
        """Stop the child for good: a request it may still be working on must never answer a later one."""
        self._gone = why
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)


def _serve(conn, spec_json: str, threads: int, runners: list[str]) -> None:
    """The child: build the worker, then answer ``ready`` / ``load_weights`` / ``run`` until ``close``."""
    import importlib

    import torch

    torch.set_num_threads(threads)
    from ctxrl.plugins import import_plugins

    spec = json.loads(spec_json)
    worker = None
    while True:
        try:
            header = json.loads(conn.recv_bytes())
            payload = conn.recv_bytes()
        except EOFError:
            return
        op = header["op"]
        if op == "close":
            return
        try:
            if worker is None:
                from ctxrl.rollout.worker import RolloutWorker

                import_plugins(spec.get("plugins", ""))  # custom managers must be registered before the spec is read
                for module in runners:  # the parent's episode runners (ctxrl.rollout.runners)
                    importlib.import_module(module)
                worker = RolloutWorker.from_spec(RolloutSpec.from_dict(spec))
            if op == "ready":
                reply: dict[str, Any] = {"ok": True}
            elif op == "load_weights":
                from safetensors.torch import load

                worker.load_weights(load(payload), version=header["version"], partial=header.get("partial", False))
                reply = {"ok": True}
            elif op == "run":
                episodes = worker.run(RolloutRequest.from_dict(header["request"]))
                reply = {"episodes": [e.to_dict() for e in episodes]}
            else:
                reply = {"error": f"unknown operation {op!r}"}
        except Exception:  # noqa: BLE001 - sent to the parent, which raises it as a WorkerError
            reply = {"error": traceback.format_exc()}
        conn.send_bytes(json.dumps({**reply, "seq": header.get("seq")}).encode())
