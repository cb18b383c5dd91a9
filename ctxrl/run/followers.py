"""Data-parallel learner ranks (``torchrun``): rank 0, the leader, does everything else; the followers take the
leader's weights when RL starts, then update on their shares of the leader's rows until told to stop
(``ctxrl.distributed.data_parallel``). One process (no ``parallel``) makes every call a no-op."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Followers:
    """The leader's side of the protocol (``start``, ``update``, ``release``) and a follower's run (``follow``)."""

    def __init__(self, parallel) -> None:
        self.parallel = parallel
        self.released = False

    def start(self, policy) -> None:
        """Tell the follower ranks RL starts, and give them the (warm-started) weights."""
        if self.parallel is not None:
            scaler = policy.precision.scaler  # (the warm start may have moved the loss scale: rank 0's holds)
            self.parallel.broadcast_object(("start", None if scaler is None else scaler.state_dict()))
            self.parallel.broadcast_module(policy.model)

    def update(self, rows: list) -> None:
        """Hand the step's rows to the follower ranks, which train on their shares of them."""
        if self.parallel is not None:
            self.parallel.broadcast_object(("update", rows))

    def release(self) -> None:
        """Tell the follower ranks the run is over (also when it failed: they would otherwise wait)."""
        if self.parallel is not None and not self.released:
            self.released = True
            try:
                self.parallel.broadcast_object(("stop", None))
            except Exception as exc:  # noqa: BLE001 - never hide the error that ended the run
                log.warning("could not tell the follower ranks to stop (%s); torchrun ends them with this rank", exc)

    def follow(self, policy, make_learner: Callable[[], Any]) -> dict[str, Any]:
        """A follower rank's run: take the leader's weights, then update on the leader's rows until told to stop."""
        kind, scaler_state = self.parallel.broadcast_object()
        updates = 0
        if kind == "start":
            if scaler_state is not None:
                policy.precision.scaler.load_state_dict(scaler_state)
            self.parallel.broadcast_module(policy.model)
            learner = make_learner()
            while True:
                kind, rows = self.parallel.broadcast_object()
                if kind != "update":
                    break
                if rows:
                    learner.update(learner.collate(rows))
                updates += 1
        return {"follower": True, "rank": self.parallel.rank, "updates": updates}
