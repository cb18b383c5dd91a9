"""The fast engine's host-side steps between decode chunks: batched prefix copies, transfers, a chunk's outputs.

The agentic profile (``benchmarks/grpo_step.py --profile``) found the engine's thread, not the GPU, bounding
multi-turn rollouts: prefix copies one layer and slot at a time, transfers that waited for the device, a chunk's
outputs converted row by row. These tests hold the faster forms to the old ones' results.
"""

from __future__ import annotations

import random

import torch

from ctxrl.engine.fast.decode import Chunk
from ctxrl.engine.fast.model import SlotCache, to_device


def _cache(layers=3, slots=6, heads=2, capacity=20, dim=4, seed=0) -> SlotCache:
    cache = SlotCache(layers, slots, heads, capacity, dim, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    cache.k_all.copy_(torch.randn(cache.k_all.shape, generator=g))
    cache.v_all.copy_(torch.randn(cache.v_all.shape, generator=g))
    return cache


def _sequential(cache: SlotCache, copies) -> None:
    for src, dst, n in copies:
        for layer in range(len(cache.k)):
            cache.k[layer][dst, :, :n] = cache.k[layer][src, :, :n].clone()
            cache.v[layer][dst, :, :n] = cache.v[layer][src, :, :n].clone()


def test_layers_are_views_of_one_tensor():
    cache = _cache()
    cache.k[1][2, 0, 5] = 7.0
    assert cache.k_all[1, 2, 0, 5].eq(7.0).all()
    assert cache.nbytes == 2 * cache.k_all.numel() * 4


def test_batched_copies_give_every_destination_its_sources_prefix():
    copies = [(0, 3, 5), (0, 4, 5), (1, 5, 12), (2, 2, 9), (1, 0, 0)]  # (2, 2) and length 0: nothing to do
    want, got = _cache(), _cache()
    _sequential(want, copies)
    got.copy_prefixes(copies)
    for _, dst, n in copies:  # within each destination's length: exactly the sequential result
        assert torch.equal(got.k_all[:, dst, :, :n], want.k_all[:, dst, :, :n])
        assert torch.equal(got.v_all[:, dst, :, :n], want.v_all[:, dst, :, :n])
    for slot in (0, 1, 2):  # slots that were no destination are untouched
        assert torch.equal(got.k_all[:, slot], _cache().k_all[:, slot])


def test_overlapping_copies_run_in_order_exactly():
    # 3 -> 4 then 4 -> 5: slot 5 must get what slot 4 holds after the first copy
    copies = [(3, 4, 8), (4, 5, 6), (1, 5, 3)]
    want, got = _cache(), _cache()
    _sequential(want, copies)
    got.copy_prefixes(copies)
    assert torch.equal(got.k_all, want.k_all) and torch.equal(got.v_all, want.v_all)


def test_many_copies_in_several_batches_match(monkeypatch):
    monkeypatch.setattr(SlotCache, "COPY_BYTES", 1)  # one copy per batch
    rng = random.Random(0)
    sources = [0, 1, 2]
    copies = [(rng.choice(sources), dst, rng.randrange(1, 20)) for dst in range(3, 12)]
    want, got = _cache(slots=12), _cache(slots=12)
    _sequential(want, copies)
    got.copy_prefixes(copies)
    for _, dst, n in copies:
        assert torch.equal(got.k_all[:, dst, :, :n], want.k_all[:, dst, :, :n])


def test_to_device_keeps_values_and_dtype():
    t = to_device([[1.5], [2.0]], torch.device("cpu"), torch.float32)
    assert t.dtype == torch.float32 and t.tolist() == [[1.5], [2.0]]
    assert to_device([3, 1], torch.device("cpu")).dtype == torch.long
    assert to_device([True, False], torch.device("cpu"), torch.bool).tolist() == [True, False]


def test_a_chunks_outputs_per_slot():
    tokens = torch.arange(24).view(4, 6)
    logprobs = -torch.arange(24, dtype=torch.float32).view(4, 6) / 10
    chunk = Chunk(rows={0: None, 2: None}, steps=3, buffer=(tokens, logprobs), done=None)
    assert chunk.outputs(2) == [(12, -1.2000000476837158), (13, -1.2999999523162842), (14, -1.399999976158142)]
    assert [t for t, _ in chunk.outputs(0)] == [0, 1, 2]


def test_prefill_token_layout_matches_the_per_token_lists():
    from ctxrl.engine.fast.prefill import token_layout

    rng = random.Random(3)
    for _ in range(20):
        n = rng.randrange(1, 7)
        starts = [rng.randrange(0, 50) for _ in range(n)]
        counts = [rng.randrange(1, 9) for _ in range(n)]
        slots = rng.sample(range(20), n)
        positions, slot_of, row_of, offset, last = [], [], [], [], []
        for i in range(n):  # the lists the prefill used to build on the host
            positions += range(starts[i], starts[i] + counts[i])
            slot_of += [slots[i]] * counts[i]
            row_of += [i] * counts[i]
            offset += range(counts[i])
            last.append(len(positions) - 1)
        got = token_layout(torch.tensor([starts, counts, slots]), sum(counts))
        assert [t.tolist() for t in got] == [positions, slot_of, row_of, offset, last]


def test_best_match_is_the_longest_common_prefix_lowest_slot_first_with_claimed_slots_indexed_or_not():
    """``SlotTable.best_match`` against brute force: among parked slots and slots claimed earlier in the round, the
    longest common prefix with ``prompt[:-1]`` (at least one block) wins, the lowest slot among equals. ``Claimed``
    (the round's index of claimed slots by first block) and a plain dict give the same answer."""
    from ctxrl.engine.fast.slots import BLOCK, Claimed, SlotTable

    def brute(table, prompt, claimed):
        target = tuple(prompt[:-1])
        best, best_len = None, 0
        for slot in sorted(set(table.parked) | set(claimed)):
            ids = table.parked.get(slot, claimed.get(slot))
            n = 0
            while n < min(len(ids), len(target)) and ids[n] == target[n]:
                n += 1
            if n > best_len:
                best, best_len = slot, n
        return (best, best_len) if best_len >= BLOCK else (None, 0)

    rng = random.Random(7)
    for case in range(300):
        heads = [[rng.randrange(3) for _ in range(BLOCK)] for _ in range(2)]  # few first blocks: many share one

        def ids(n, heads=heads):
            return rng.choice(heads) + [rng.randrange(2) for _ in range(n)]

        table = SlotTable(10)
        slots = rng.sample(range(10), rng.randrange(1, 10))
        for slot in slots:
            table.park(slot, ids(rng.randrange(0, 40)))
        taken = rng.sample(slots, rng.randrange(0, len(slots)))
        plain, indexed = {}, Claimed()
        for slot in taken:
            held = table.parked[slot]
            plain[slot] = indexed[slot] = held
        for slot in taken:
            table._forget(slot)
        for _ in range(5):
            base = rng.choice([table.parked[s] for s in table.parked] + list(plain.values()) + [()])
            tail = [rng.randrange(2) for _ in range(rng.randrange(1, 20))]
            prompt = list(base[:rng.randrange(0, len(base) + 1)]) + tail
            if len(prompt) < 2:
                continue
            want = brute(table, prompt, plain)
            assert table.best_match(prompt, plain) == want, (case, prompt)
            assert table.best_match(prompt, indexed) == want, (case, prompt)


def test_parking_extends_the_prompts_hashes_and_they_equal_hashing_from_scratch():
    """``place`` keeps the prompt's block hashes for its slot; ``park`` goes on from them instead of hashing the
    prompt again. The index must be what hashing the kept ids from scratch gives, including when the kept ids do
    not start with the placed prompt (then nothing is reused)."""
    from ctxrl.engine.fast.slots import BLOCK, SlotTable, block_hashes

    rng = random.Random(11)
    table = SlotTable(6)
    prompts = {i: [rng.randrange(50) for _ in range(rng.randrange(2, 70))] for i in range(6)}
    for turn in range(4):
        placed = {}
        for i, prompt in prompts.items():
            placement = table.place(prompt, {})
            placed[i] = placement.slot
            assert table.started[placement.slot][1] == block_hashes(prompt[:-1])
        for i, slot in placed.items():
            kept = prompts[i] + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
            if i == 5 and turn == 2:  # ids that are not the prompt's continuation: hashed from scratch
                kept = [7] * (BLOCK * 3)
            table.park(slot, kept)
            assert slot not in table.started
            assert table.hashes[slot] == block_hashes(kept)
            prompts[i] = kept + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
    index = {}
    for slot, hashes in table.hashes.items():
        for h in hashes:
            index.setdefault(h, set()).add(slot)
    assert {h: table.holders(h) for h in table.index} == index
    # one holder is kept as the slot itself, several as a set (fewer objects for the garbage collector)
    assert all(isinstance(v, int) == (len(index[h]) == 1) for h, v in table.index.items())
    # a released slot forgets what it started with
    slot = table.place([1] * 40, {}).slot
    table.release(slot)
    assert slot not in table.started


def test_block_hashes_go_on_from_known_ones():
    from ctxrl.engine.fast.slots import BLOCK, block_hashes

    ids = list(range(5 * BLOCK + 3))
    full = block_hashes(ids)
    for k in range(len(full) + 1):
        assert block_hashes(ids, full[:k]) == full
    assert block_hashes(tuple(ids)) == full
