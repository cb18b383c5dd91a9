"""Which weights the rollout engine plays: phase 5 of a step (``sync_engine``), and the learner's current weights
for an evaluation (``current_weights``).

In one process with ``distributed.max_staleness = η`` the engine plays weights held ``η`` versions behind the
learner's (``ctxrl.distributed.staleness``); with Ray's asynchronous rounds the actors take new weights after what
they are playing. A checkpoint's restore hands its weights over through ``sync_engine(restored=True)`` too.
"""

from __future__ import annotations

from contextlib import contextmanager

from ctxrl.distributed.staleness import LaggedWeights


def sync_engine(run, version: int, *, restored: bool = False) -> None:
    """Phase 5: hand the policy's current weights (LoRA: its adapters) to the worker's engine, as policy
    ``version``; in one process with ``distributed.max_staleness``, the weights of that many versions before.

    ``restored``: the weights a checkpoint gave back; the lag starts again from them (the older ones are not in
    the checkpoint).
    """
    state, partial = run.policy.engine_state()
    if run.lagged is not None:
        if restored:
            run.lagged = LaggedWeights(run.lagged.lag)
        played = run.lagged.playing()
        held = run.lagged.push(version, state, partial)
        if held is not played:  # (a new state: another version, or version 0's replaced by the warm start's)
            version, state, partial = held
            run.worker.load_weights(state, version=version, partial=partial)
    elif run.config.distributed.max_staleness > 0:  # the actors take it after what they are playing now
        run.worker.load_weights(state, version=version, partial=partial, wait=False)
    else:
        run.worker.load_weights(state, version=version, partial=partial)
    run.own.sync(run.worker, version)


@contextmanager
def current_weights(run):
    """The engine plays the learner's current weights inside (an evaluation), the lagged ones again after."""
    held = run.lagged.current() if run.lagged is not None else None
    if held is None or held is run.lagged.playing():
        yield
        return
    state, partial = run.policy.engine_state()
    run.worker.load_weights(state, version=held[0], partial=partial)
    try:
        yield
    finally:
        version, state, partial = run.lagged.playing()
        run.worker.load_weights(state, version=version, partial=partial)
