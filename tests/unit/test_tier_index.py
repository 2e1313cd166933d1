"""The tier's index (kvxferd/tier/index.py): what a lookup may see, what eviction may take,
and that the bytes it promised are never exceeded."""

from __future__ import annotations

from kvxferd.tier.index import TierIndex

K = [bytes([i]) for i in range(16)]


def test_a_chunk_being_written_is_invisible_and_never_evicted() -> None:
    index = TierIndex(limit_bytes=2048, high=1.0, low=1.0)
    ns = index.namespace("n", 1024, all_heads=0b1)
    [writing] = index.reserve(ns, K[:1], 0b1)
    assert index.lookup(ns, K[:1]) == 0
    assert [c.key for c in index.reserve(ns, K[1:2], 0b1)] == [K[1]]
    assert index.reserve(ns, K[2:3], 0b1) == []  # full, and both chunks are being written
    index.finish(ns, K[:2], 0b1)
    assert index.lookup(ns, K[:2]) == 2 and writing.complete


def test_a_pinned_chunk_is_never_evicted_and_a_failed_store_leaves_nothing() -> None:
    index = TierIndex(limit_bytes=2048, high=1.0, low=0.5)
    ns = index.namespace("n", 1024, all_heads=0b1)
    index.reserve(ns, K[:2], 0b1)
    index.finish(ns, K[:2], 0b1)
    index.pin([index.get(ns, K[0])])  # type: ignore[list-item]
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
        got = index.reserve(ns, [turn.to_bytes(4, "little")], 0b1)
        index.finish(ns, [c.key for c in got], 0b1, ok=turn % 5 != 0)
        index.take_released()
        assert index.used_bytes <= index.committed_bytes <= index.limit_bytes
        free = sum(len(s.free) * s.chunk_bytes for s in spaces)
        assert index.committed_bytes == index.used_bytes + free
