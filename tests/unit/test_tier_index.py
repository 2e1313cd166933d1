"""The tier's index (kvxferd/tier/index.py): what a lookup may see, what eviction may take,
where a chunk lives (host, disk, both), and that the bytes it promised are never exceeded."""

from __future__ import annotations

from kvxferd.tier.index import TierIndex

K = [bytes([i]) for i in range(16)]


def test_a_chunk_being_written_is_invisible_and_never_evicted() -> None:
    index = TierIndex(limit_bytes=2048, high=1.0, low=1.0)
    ns = index.namespace("n", 1024, all_heads=0b1)
    [writing] = index.reserve(ns, K[:1], 0b1)
    assert index.lookup(ns, K[:1]) == 0
    assert [c.key for c in index.reserve(ns, K[1:2], 0b1)] == [K[1]]
    assert index.make_room(ns, 1) == [] and index.reserve(ns, K[2:3], 0b1) == []  # both being written
    index.finish(ns, K[:2], 0b1)
    assert index.lookup(ns, K[:2]) == 2 and writing.complete


def test_a_pinned_chunk_is_never_evicted_and_a_failed_store_leaves_nothing() -> None:
    index = TierIndex(limit_bytes=2048, high=1.0, low=0.5)
    ns = index.namespace("n", 1024, all_heads=0b1)
    index.reserve(ns, K[:2], 0b1)
    index.finish(ns, K[:2], 0b1)
    index.pin([index.get(ns, K[0])])  # type: ignore[list-item]
    index.make_room(ns, 1)
    assert [c.key for c in index.reserve(ns, K[2:3], 0b1)] == [K[2]]
    assert index.get(ns, K[1]) is None and index.get(ns, K[0]) is not None  # the unpinned one went
    index.finish(ns, K[2:3], 0b1, ok=False)
    assert index.get(ns, K[2]) is None and index.used_bytes == 1024


def test_a_chunk_appears_once_every_rank_stored_its_heads() -> None:
    index = TierIndex(limit_bytes=1 << 20)
    ns = index.namespace("n", 1024, all_heads=0b1111)
    index.reserve(ns, K[:2], 0b0011)
    index.finish(ns, K[:2], 0b0011)
    assert index.lookup(ns, K[:2]) == 0
    assert index.reserve(ns, K[:2], 0b0011) == []  # those heads are in
    index.reserve(ns, K[:1], 0b1100)
    index.finish(ns, K[:1], 0b1100)
    assert index.lookup(ns, K[:2]) == 1


def test_eviction_runs_in_batches_down_to_the_low_watermark_over_every_namespace() -> None:
    index = TierIndex(limit_bytes=8 * 1024, high=1.0, low=0.5)
    a, b = index.namespace("a", 1024, 0b1), index.namespace("b", 2048, 0b1)
    index.reserve(a, K[:8], 0b1)
    index.finish(a, K[:8], 0b1)
    index.lookup(a, K[:1])  # the first is used again: last to go
    assert index.make_room(b, 1) == []
    [chunk] = index.reserve(b, K[:1], 0b1)
    assert [k for k in K[:8] if index.get(a, k)] == [K[0], K[7]]  # down to 4 KiB, then b's
    assert index.used_bytes == 2 * 1024 + 2048 and a.evictions == 6 and chunk.slot == 0
    # b's slot needed new pages: two of a's free slots gave theirs back, nothing more.
    assert index.take_released() == [(a, 1), (a, 2)]
    assert index.committed_bytes == index.limit_bytes


def test_committed_pages_never_exceed_the_limit_however_namespaces_take_turns() -> None:
    index = TierIndex(limit_bytes=64 * 1024, high=1.0, low=0.75)
    spaces = [index.namespace(name, size, 0b1) for name, size in (("a", 1024), ("b", 4096), ("c", 3072))]
    for turn in range(300):
        ns = spaces[turn % 3 if turn % 7 else 0]
        index.make_room(ns, 1)
        got = index.reserve(ns, [turn.to_bytes(4, "little")], 0b1)
        index.finish(ns, [c.key for c in got], 0b1, ok=turn % 5 != 0)
        index.take_released()
        assert index.used_bytes <= index.committed_bytes <= index.limit_bytes
        free = sum(len(s.free) * s.chunk_bytes for s in spaces)
        assert index.committed_bytes == index.used_bytes + free


def test_evicted_chunks_spill_to_disk_and_come_back_through_a_promotion() -> None:
    index = TierIndex(limit_bytes=2048, high=1.0, low=1.0, disk_limit_bytes=2048)
    ns = index.namespace("n", 1024, 0b1)
    index.reserve(ns, K[:2], 0b1)
    index.finish(ns, K[:2], 0b1)
    [spill] = index.make_room(ns, 1)  # k0 must leave host memory: written to disk first
    assert spill.key == K[0] and spill.spilling and index.reserve(ns, K[2:3], 0b1) == []  # not yet
    assert index.disk_slot(spill) == 0
    index.spilled(spill, ok=True)
    assert spill.slot is None and index.lookup(ns, K[:2]) == 2 and ns.disk_hits == 1
    assert len(index.reserve(ns, K[2:3], 0b1)) == 1
    index.finish(ns, K[2:3], 0b1)
    assert index.promote(spill) is None  # host memory is full: make room first
    [out] = index.make_room(ns, 1)
    assert out.key == K[1]  # k0 and k2 were used since
    assert index.disk_slot(out) == 1
    index.spilled(out, ok=True)
    slot = index.promote(spill)
    assert slot is not None and spill.promoting and index.lookup(ns, K[:1]) == 1
    index.promoted(spill, ok=True)
    assert (ns.chunks, ns.disk_chunks, index.disk_used_bytes) == (2, 1, 2048)


def test_what_cannot_be_written_or_read_back_is_dropped_and_the_disk_limit_holds() -> None:
    index = TierIndex(limit_bytes=1024, high=1.0, low=1.0, disk_limit_bytes=2048)
    ns = index.namespace("n", 1024, 0b1)
    for i in range(6):
        for spill in index.make_room(ns, 1):
            assert index.disk_slot(spill) is not None
            index.spilled(spill, ok=i != 3)  # the fourth write fails
        index.reserve(ns, K[i : i + 1], 0b1)
        index.finish(ns, K[i : i + 1], 0b1)
        assert index.disk_used_bytes <= 2048 and index.used_bytes <= 1024
    assert ns.disk_failures == 1 and index.get(ns, K[2]) is None  # never served
    assert [k for k in K[:6] if index.get(ns, k)] == [K[3], K[4], K[5]]  # disk LRU evicted k0, k1
    [out] = index.make_room(ns, 1)  # k5 leaves host memory for disk, where k3 makes room
    assert index.disk_slot(out) is not None
    index.spilled(out, ok=True)
    back = index.get(ns, K[4])
    assert back is not None and back.slot is None and index.promote(back) is not None
    index.promoted(back, ok=False)  # read back other bytes: dropped, never served
    assert index.get(ns, K[4]) is None and ns.disk_failures == 2
    assert [k for k in K[:6] if index.get(ns, k)] == [K[5]]
