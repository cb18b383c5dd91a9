"""Which cache slot each request decodes in, and which finished conversations are kept for reuse.

Pure bookkeeping (no tensors), so every rule is tested on the CPU:

- A slot is **free**, **active** (a request is decoding in it) or **parked**: a finished
  request's keys and values stay in it, with the ids they belong to, until the slot is needed.
- A new request takes the parked slot whose ids share the longest prefix with its prompt (an
  episode's next turn extends its last turn: prompt + sampled + observation), so only the new
  tail is prefilled. At least the prompt's last token is always prefilled: its logits start
  the completion. A second request matching the same parked slot gets a free slot and a copy
  of the matched prefix.
- With no free slot, the least recently used parked slot is evicted (its ids forgotten; a later
  request that would have matched recomputes them). With none to evict, the request waits.
- Lower slots are preferred, so the active rows stay packed at the bottom of the table, where
  the decode step runs over slots ``0..hi``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCK = 16
"""Prefixes are indexed by blocks of this many ids; a shared prefix shorter than one block is not reused
(recomputing it costs less than the bookkeeping)."""


def block_hashes(ids, known: list[int] | None = None) -> list[int]:
    """Chained hashes of ``ids``' whole blocks: entry ``j`` stands for ``ids[:BLOCK * (j + 1)]``.

    ``known``: the hashes of ``ids``' first ``len(known)`` blocks, already computed (the caller vouches that they
    are ``ids``'): the chain goes on from there."""
    ids = ids if isinstance(ids, tuple) else tuple(ids)  # (a tuple's slices are tuples: one copy a block, not two)
    out = list(known or ())
    h = out[-1] if out else 0
    for start in range(BLOCK * len(out), len(ids) - BLOCK + 1, BLOCK):
        h = hash((h, ids[start:start + BLOCK]))
        out.append(h)
    return out


class Claimed(dict):
    """The parked slots taken in one admission round, slot -> kept ids (``SlotTable.place``), indexed by their first
    block: a later request of the round looks up the slots that start as its prompt does, not every slot claimed so
    far (a round of 512 next turns was 130,000 comparisons, a sixth of a second on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_head: dict[tuple[int, ...], set[int]] = {}

    def __setitem__(self, slot: int, ids: tuple[int, ...]) -> None:
        super().__setitem__(slot, ids)
        if len(ids) >= BLOCK:
            self.by_head.setdefault(tuple(ids[:BLOCK]), set()).add(slot)

    def starting_as(self, prompt) -> set[int]:
        return self.by_head.get(tuple(prompt[:BLOCK]), set())


@dataclass
class Placement:
    """Where a request goes: its slot, and how many prompt positions are already there (or copied from ``source``)."""

    slot: int
    cached: int = 0
    source: int | None = None


@dataclass
class SlotTable:
    slots: int
    free: list[int] = field(default_factory=list)
    parked: dict[int, tuple[int, ...]] = field(default_factory=dict)
    last_used: dict[int, int] = field(default_factory=dict)
    active: set[int] = field(default_factory=set)
    clock: int = 0
    index: dict[int, int | set[int]] = field(default_factory=dict)
    """Block hash -> the parked slot whose ids start with that chain of blocks, or a set of them where several do
    (a group's shared prompt). One slot is an int, not a set of one: parking 512 episodes a turn created tens of
    thousands of sets, whose collections by the garbage collector were most of the parking's time (``holders``)."""
    hashes: dict[int, list[int]] = field(default_factory=dict)
    started: dict[int, tuple[tuple[int, ...], list[int]]] = field(default_factory=dict)
    """Active slot -> its request's prompt (less the last id) and that prompt's block hashes, which ``place``
    computed: parking the slot extends them instead of hashing the prompt again."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"a slot table needs at least one slot, got {self.slots}")
        self.free = list(range(self.slots))

    def holders(self, h: int) -> set[int]:
        """The parked slots indexed under block hash ``h``."""
        found = self.index.get(h)
        return set() if found is None else {found} if isinstance(found, int) else set(found)

    def _forget(self, slot: int) -> tuple[int, ...] | None:
        index = self.index
        for h in self.hashes.pop(slot, []):
            holders = index.get(h)
            if holders is None:
                continue
            if isinstance(holders, int):
                if holders == slot:
                    del index[h]
                continue
            holders.discard(slot)
            if len(holders) == 1:
                index[h] = next(iter(holders))
        return self.parked.pop(slot, None)

    def _take_free(self) -> int | None:
        if self.free:
            slot = min(self.free)
            self.free.remove(slot)
            return slot
        if self.parked:
            victim = min(self.parked, key=lambda s: (self.last_used[s], s))
            self._forget(victim)
            return victim
        return None

    def best_match(self, prompt: list[int], also: dict[int, tuple[int, ...]] | None = None) -> tuple[int | None, int]:
        """The slot whose kept ids share the longest prefix with ``prompt`` (at most ``len(prompt) - 1``).

        Parked slots are searched through the block index, and ``also`` (slots claimed earlier in
        this admission round, whose kept prefix stays intact until the round's prefill)."""
        return self._match(prompt, also)[:2]

    def _match(self, prompt: list[int], also) -> tuple[int | None, int, tuple[int, ...], list[int]]:
        """``best_match``, and the prompt less its last id with that part's block hashes."""
        limit = len(prompt) - 1
        target = tuple(prompt[:limit])
        prompt_hashes = block_hashes(target)
        deepest: int | set[int] = set()
        for h in prompt_hashes:  # the deepest block some parked slot shares
            holders = self.index.get(h)
            if holders is None:
                break
            deepest = holders
        deepest = {deepest} if isinstance(deepest, int) else set(deepest)
        extra = also or {}
        if isinstance(extra, Claimed):
            others = extra.starting_as(prompt) - deepest
        else:
            others = {slot for slot, ids in extra.items()
                      if len(ids) >= BLOCK and tuple(ids[:BLOCK]) == tuple(prompt[:BLOCK])} - deepest
        # The longest common prefix wins, the lowest slot among equals. The deepest-indexed slots go first: once
        # one has set the length to beat, another candidate is measured only if it matches one id further.
        best, best_len = None, 0
        for slot in sorted(deepest) + sorted(others):
            ids = self.parked.get(slot, extra.get(slot))
            if best is not None and ids[:best_len + 1] != target[:best_len + 1]:  # not longer; perhaps as long
                if slot < best and ids[:best_len] == target[:best_len]:
                    best = slot
                continue
            length = self.common_prefix(ids, target)
            if length > best_len or (length == best_len and best is not None and slot < best):
                best, best_len = slot, length
        return ((best, best_len) if best_len >= BLOCK else (None, 0)) + (target, prompt_hashes)

    @staticmethod
    def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """Length of the longest common prefix, by halving slices compared in C."""
        lo, hi = 0, min(len(a), len(b))
        if a[:hi] == b[:hi]:
            return hi
        while lo < hi:  # a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1] hold throughout
            mid = (lo + hi + 1) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def place(self, prompt: list[int], claimed: Claimed | dict[int, tuple[int, ...]]) -> Placement | None:
        """A slot for ``prompt`` (``None``: none free now).

        ``claimed`` collects the parked slots taken in this admission round (slot -> kept ids): a
        later request of the round that matches one gets a free slot and a copy of the prefix,
        which the engine makes before the round's prefill overwrites anything."""
        slot, length, head, hashes = self._match(prompt, claimed)
        if slot is not None and slot in self.parked:
            claimed[slot] = self._forget(slot)
            placement = Placement(slot, length)
        else:
            target = self._take_free()
            if target is None:
                return None
            placement = Placement(target, length, source=slot) if slot is not None else Placement(target)
        self.clock += 1
        self.active.add(placement.slot)
        self.last_used[placement.slot] = self.clock
        self.started[placement.slot] = (head, hashes)
        return placement

    def take(self) -> Placement | None:
        """A slot with nothing reusable in it (``None``: none free now)."""
        slot = self._take_free()
        if slot is None:
            return None
        self.clock += 1
        self.active.add(slot)
        self.last_used[slot] = self.clock
        self.started.pop(slot, None)
        return Placement(slot)

    def park(self, slot: int, ids: list[int]) -> None:
        """Keep ``ids`` (whose keys and values the slot holds) for a later request to extend."""
        self.active.discard(slot)
        self._forget(slot)
        self.clock += 1
        self.parked[slot] = kept = tuple(ids)
        self.last_used[slot] = self.clock
        prompt, known = self.started.pop(slot, ((), []))
        done = BLOCK * len(known)  # the kept ids start with the prompt: its hashes stand (checked, one compare)
        self.hashes[slot] = block_hashes(kept, known if kept[:done] == prompt[:done] else None)
        index = self.index
        for h in self.hashes[slot]:  # (a set only where a second slot shares the block: allocations wake the GC)
            holders = index.get(h)
            if holders is None:
                index[h] = slot
            elif isinstance(holders, int):
                if holders != slot:
                    index[h] = {holders, slot}
            else:
                holders.add(slot)

    def release(self, slot: int) -> None:
        """Forget a slot's contents (a failed or cancelled request)."""
        self.active.discard(slot)
        self.started.pop(slot, None)
        self._forget(slot)
        if slot not in self.free:
            self.free.append(slot)

    @property
    def high(self) -> int:
        """One past the highest active slot: the decode step runs over slots ``0..high``."""
        return max(self.active) + 1 if self.active else 0
