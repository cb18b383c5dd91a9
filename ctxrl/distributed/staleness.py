"""Bounded staleness in one process: the engine's weights held a fixed number of versions behind the learner's.

With ``distributed.backend = "ray"`` and ``distributed.max_staleness > 0`` the next step's episodes are played
while this step trains (``ctxrl.run.collect.Collector.asynchronous_round``): that saves time, and its
episodes are one version old. In one process the rollout and the update cannot overlap, so
``max_staleness = eta`` there *reproduces* the off-policy gap instead: the engine plays RL step ``s`` with
the weights of version ``max(s - eta, 0)``, so every training episode is exactly ``min(s, eta)`` versions
old. No time is saved; what it is for is studying the off-policy corrections (``algo.offpolicy``) and the
decoupled objective on one card, at a staleness Ray's prefetch does not reach.

``LaggedWeights`` keeps the last ``eta + 1`` engine states, copied to host memory (they stay out of the
card's memory plan). A checkpoint does not hold them: after a resume the lag builds up again over ``eta``
steps, which the step's ``staleness_mean`` figure shows. Evaluations play the learner's current weights
(``current``), never the lagged ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import torch


class LaggedWeights:
    """The last ``lag + 1`` engine states by version; ``push`` returns the one the engine should play."""

    def __init__(self, lag: int) -> None:
        if lag < 1:
            raise ValueError(f"a lag of {lag} versions holds nothing back; use 1 or more (0 is on-policy training)")
        self.lag = lag
        self._held: deque[tuple[int, dict[str, torch.Tensor], bool]] = deque()

    def push(self, version: int, state: Mapping[str, torch.Tensor],
             partial: bool) -> tuple[int, dict[str, torch.Tensor], bool]:
        """Hold ``state`` as ``version`` (a copy, on the host) and return ``(version, state, partial)`` of the
        oldest state within the lag: ``version - lag``, or the oldest held (the first steps, and after a resume).

        Versions must not go back; the same version again replaces its state (the warm start's weights replace
        the initial ones as version 0).
        """
        if self._held and version < self._held[-1][0]:
            raise ValueError(f"policy version {version} is older than the held {self._held[-1][0]}: versions only "
                             "go forward (a resume starts a new LaggedWeights)")
        if self._held and version == self._held[-1][0]:
            self._held.pop()
        self._held.append((version, {name: t.detach().to("cpu", copy=True) for name, t in state.items()}, partial))
        while self._held[0][0] < version - self.lag:
            self._held.popleft()
        return self._held[0]

    def current(self) -> tuple[int, dict[str, torch.Tensor], bool] | None:
        """The newest state held (the learner's), or None before the first ``push``."""
        return self._held[-1] if self._held else None

    def playing(self) -> tuple[int, dict[str, torch.Tensor], bool] | None:
        """What ``push`` last returned (the state the engine plays), or None before the first ``push``."""
        return self._held[0] if self._held else None


def lagged_weights(distributed, policy) -> LaggedWeights | None:
    """The held states of a run in one process with ``distributed.max_staleness`` (a ``DistributedConfig``), the
    policy's initial weights held as version 0 until a warm start's replace them; None on Ray or without a lag."""
    if distributed.backend != "none" or distributed.max_staleness <= 0:
        return None
    lagged = LaggedWeights(distributed.max_staleness)
    lagged.push(0, *policy.engine_state())
    return lagged
