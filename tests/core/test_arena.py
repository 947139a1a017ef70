"""The arena on the CPU: compaction slides regions down in chunks without corrupting them.

Regions are filled with known random bytes; after every compaction each live region must hold
exactly its bytes, and exactly the regions that moved have a new version.
"""

import random

import pytest
import torch

from computron.memory.arena import Arena, OutOfMemory, Region
from computron.memory.units import ALIGN, align_up


def fill(region, seed):
    data = torch.randint(0, 256, (region.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    region.tensor.copy_(data)
    return data


def check_layout(arena):
    regions = arena.regions()
    cursor = 0
    for r in regions:  # sorted, aligned, inside the buffer, no overlap
        assert r.offset % ALIGN == 0 and r.nbytes % ALIGN == 0
        assert r.offset >= cursor, "regions overlap or are out of order"
        cursor = r.offset + r.nbytes
    assert cursor <= arena.nbytes
    assert arena.free == arena.nbytes - sum(r.nbytes for r in regions)


def largest_hole(arena):
    cursor, best = 0, 0
    for r in arena.regions():
        best = max(best, r.offset - cursor)
        cursor = r.offset + r.nbytes
    return max(best, arena.nbytes - cursor)


def test_compaction_copies_large_regions_in_many_chunks_and_keeps_their_bytes():
    K = ALIGN
    arena = Arena(40 * K, "cpu")
    keep = arena.allocate(2 * K, "weights", "keep")  # before the first hole: never moves
    hole1 = arena.allocate(2 * K, "kv", "hole1")
    big = arena.allocate(19 * K, "weights", "big")  # 19 K behind a 2 K hole: 10 chunks, the last a half
    hole2 = arena.allocate(1 * K, "kv", "hole2")
    mid = arena.allocate(7 * K, "kv", "mid")  # behind a 3 K hole after big moves: 3 chunks
    tail = arena.allocate(3 * K, "kv", "tail")
    assert arena.free == 6 * K
    data = {r.owner: fill(r, i) for i, r in enumerate([keep, big, mid, tail])}
    arena.release(hole1)
    arena.release(hole2)
    # 9 K free in holes of 2 K, 1 K and 6 K: 8 K fits only after compaction.
    assert arena.free == 9 * K and largest_hole(arena) == 6 * K
    assert big.nbytes > 2 * (big.offset - (keep.offset + keep.nbytes))  # the copy really needs several chunks
    new = arena.allocate(8 * K, "kv", "new")
    assert arena.compactions == 1
    assert (keep.offset, big.offset, mid.offset, tail.offset, new.offset) == (0, 2 * K, 21 * K, 28 * K, 31 * K)
    assert (keep.version, big.version, mid.version, tail.version, new.version) == (0, 1, 1, 1, 0)
    for r in (keep, big, mid, tail):
        assert torch.equal(r.tensor, data[r.owner]), f"{r.owner} corrupted by compaction"
    check_layout(arena)
    assert arena.free == 1 * K


def test_no_compaction_when_a_hole_is_large_enough():
    arena = Arena(16 * ALIGN, "cpu")
    a = arena.allocate(4 * ALIGN, "weights", "a")
    b = arena.allocate(4 * ALIGN, "kv", "b")
    c = arena.allocate(4 * ALIGN, "kv", "c")
    data = fill(c, 1)
    arena.release(b)
    d = arena.allocate(3 * ALIGN, "kv", "d")  # first fit: into b's hole
    assert d.offset == 4 * ALIGN and arena.compactions == 0
    assert (a.version, c.version) == (0, 0) and torch.equal(c.tensor, data)
    check_layout(arena)


def test_allocation_succeeds_exactly_when_the_bytes_fit():
    arena = Arena(12 * ALIGN, "cpu")
    regions = [arena.allocate(2 * ALIGN, "kv", f"r{i}") for i in range(6)]
    data = {r.owner: fill(r, i) for i, r in enumerate(regions)}
    for r in regions[::2]:
        arena.release(r)  # 6 K free, in three holes of 2 K
    live = regions[1::2]
    free = arena.free
    assert free == 6 * ALIGN and largest_hole(arena) == 2 * ALIGN
    # One byte more than is free: refused with the message, and nothing moves.
    with pytest.raises(OutOfMemory, match=rf"^big: {free + ALIGN} bytes of weights do not fit: "
                                          rf"{free} of {12 * ALIGN} bytes free$"):
        arena.allocate(free + 1, "weights", "big")
    assert arena.compactions == 0 and all(r.version == 0 for r in live)
    # Exactly what is free: compacts, then fits.
    big = arena.allocate(free, "weights", "big")
    assert arena.compactions == 1 and arena.free == 0
    assert [r.version for r in live] == [1, 1, 1]
    for r in live:
        assert torch.equal(r.tensor, data[r.owner])
    with pytest.raises(OutOfMemory, match=r"^x: 512 bytes of kv do not fit: 0 of 6144 bytes free$"):
        arena.allocate(1, "kv", "x")
    check_layout(arena)
    assert big.offset + big.nbytes == arena.nbytes


@pytest.mark.parametrize("seed", range(5))
def test_random_allocations_and_releases_keep_every_region_intact(seed):
    rng = random.Random(seed)
    arena = Arena(96 * ALIGN, "cpu")
    live, data = [], {}
    compactions = refused = 0
    for step in range(400):
        if live and rng.random() < 0.4:
            r = live.pop(rng.randrange(len(live)))
            arena.release(r)
            del data[r.owner]
            continue
        nbytes = rng.choice([1, ALIGN, 3 * ALIGN + 7, rng.randrange(1, 16 * ALIGN), rng.randrange(1, 16 * ALIGN)])
        size = align_up(nbytes)
        before = {r.owner: (r.offset, r.version) for r in live}
        fits, needs_compaction = size <= arena.free, size > largest_hole(arena)
        if not fits:
            with pytest.raises(OutOfMemory):
                arena.allocate(nbytes, "kv", f"r{step}")
            refused += 1
        else:
            r = arena.allocate(nbytes, "kv", f"r{step}")
            assert r.nbytes == size
            data[r.owner] = fill(r, step)
            live.append(r)
        compactions += fits and needs_compaction
        assert arena.compactions == compactions
        for r in live:
            if r.owner in before:
                offset, version = before[r.owner]
                assert r.version == version + (r.offset != offset)  # bumped exactly when moved
                assert r.offset <= offset  # compaction only slides down
            assert torch.equal(r.tensor, data[r.owner]), f"step {step}: {r.owner} corrupted"
        check_layout(arena)
    assert compactions >= 10 and refused >= 10  # the workload did exercise both


def test_resize_moves_the_end_compacting_what_lies_past_it_and_never_below_what_is_used():
    arena = Arena(64 * ALIGN, "cpu")
    regions = [arena.allocate(8 * ALIGN, "kv", f"r{i}") for i in range(6)]  # 48 of 64 units used
    data = {r.owner: fill(r, i) for i, r in enumerate(regions)}
    for r in regions[:4:2]:  # holes at the bottom: the last regions sit past 32 units
        arena.release(r)
        del data[r.owner]
    moved_before = {r.owner: r.version for r in arena.regions()}
    assert arena.resize(32 * ALIGN) == 32 * ALIGN and arena.nbytes == 32 * ALIGN
    check_layout(arena)
    assert all(r.offset + r.nbytes <= 32 * ALIGN for r in arena.regions())
    assert any(r.version > moved_before[r.owner] for r in arena.regions())  # compaction really moved some
    for r in arena.regions():
        assert torch.equal(r.tensor, data[r.owner]), f"{r.owner} corrupted by the shrink"
    with pytest.raises(OutOfMemory, match="do not fit"):
        arena.allocate(1, "kv", "past the end")
    assert arena.resize(0) == 32 * ALIGN  # four regions of 8 units are still in use
    assert arena.resize(1000 * ALIGN) == 64 * ALIGN  # at most what it was made with
    assert arena.allocate(32 * ALIGN, "kv", "fits again").offset == 32 * ALIGN


def test_holes_place_every_region_where_first_fit_over_the_regions_would():
    """Random allocations and releases of many sizes (blocks among weights): each region lands at the
    lowest offset with room, as a first fit found by walking the regions puts it, compactions
    included; the bytes in use and free stay the sums of the regions'."""
    K = ALIGN
    rng = random.Random(7)
    arena = Arena(500 * K, "cpu")
    live = []
    for step in range(3000):
        if live and (rng.random() < 0.45 or arena.free < 40 * K):
            arena.release(live.pop(rng.randrange(len(live))))
        else:
            size = K if rng.random() < 0.8 else rng.randint(2, 40) * K  # mostly blocks
            if size > arena.free:
                continue
            cursor, want = 0, None  # the reference: walk the regions for the lowest gap that holds it
            for r in arena.regions():
                if r.offset - cursor >= size:
                    want = cursor
                    break
                cursor = r.offset + r.nbytes
            if want is None and arena.nbytes - cursor >= size:
                want = cursor
            compactions = arena.compactions
            region = arena.allocate(size, "kv" if size == K else "weights", str(step))
            if want is not None:
                assert region.offset == want and arena.compactions == compactions, step
            else:  # no gap held it: the arena compacted, and it went right after the packed regions
                assert arena.compactions == compactions + 1
                assert region.offset == sum(r.nbytes for r in arena.regions()) - size
            live.append(region)
        check_layout(arena)
        assert arena.used("kv") + arena.used("weights") == sum(r.nbytes for r in arena.regions())
    with pytest.raises(ValueError, match="not in the arena"):
        arena.release(Region(0, K, "kv", "stranger"))
