"""Which waiting requests start decoding in an admission round, in which slots, reusing what.

Pure bookkeeping over the ``SlotTable`` (no tensors): the engine runs a round between decode chunks,
over the requests waiting in arrival order.

- A request whose prompt is new to the round **leads**: it takes the parked slot holding the longest
  prefix of its prompt, or a free one (``SlotTable.place``), and prefills what its slot lacks.
- A request whose prompt equals a leader's (the samples of a GRPO group) **follows** it: it takes a slot
  with nothing reusable in it (``SlotTable.take``) and, after the prefill, a copy of its leader's keys and
  values; its first token is drawn from its leader's logits with its own seed.
- Once one request finds no slot, it and every later one are **deferred** to the next round, in order:
  arrivals are served first come, first served.
- A request whose caller has cancelled it while it waited is dropped.

The prefill itself is ``prefill``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxrl.engine.fast.rows import Request
from ctxrl.engine.fast.slots import Claimed, Placement, SlotTable


@dataclass
class Round:
    leaders: list[tuple[Request, Placement]] = field(default_factory=list)
    followers: list[tuple[Request, int, int]] = field(default_factory=list)
    """(request, slot, index of its leader in ``leaders``)"""
    deferred: list[Request] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        """The requests that start: leaders, then followers."""
        return [r for r, _ in self.leaders] + [r for r, _, _ in self.followers]

    @property
    def slots(self) -> list[int]:
        """The slot of each of ``requests``."""
        return [p.slot for _, p in self.leaders] + [s for _, s, _ in self.followers]

    @property
    def logit_rows(self) -> list[int]:
        """For each of ``requests``, the leader whose prefill logits start it."""
        return list(range(len(self.leaders))) + [leader for _, _, leader in self.followers]

    @property
    def reused(self) -> int:
        """Prompt tokens whose keys and values come from a parked slot or a leader, not from a prefill."""
        return sum(p.cached for _, p in self.leaders) + sum(len(r.prompt_ids) for r, _, _ in self.followers)


def plan_round(waiting: list[Request], table: SlotTable) -> Round:
    """Place the ``waiting`` requests (in arrival order) in ``table``'s slots; see the module docstring."""
    round_ = Round()
    claimed = Claimed()
    by_prompt: dict[tuple[int, ...], int] = {}
    for request in waiting:
        if request.future.cancelled():
            continue
        if round_.deferred:
            round_.deferred.append(request)
            continue
        key = tuple(request.prompt_ids)
        if key in by_prompt:
            placement = table.take()
            if placement is None:
                round_.deferred.append(request)
                continue
            round_.followers.append((request, placement.slot, by_prompt[key]))
            continue
        placement = table.place(request.prompt_ids, claimed)
        if placement is None:
            round_.deferred.append(request)
            continue
        by_prompt[key] = len(round_.leaders)
        round_.leaders.append((request, placement))
    return round_
