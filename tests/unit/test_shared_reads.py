"""SharedReads: who joins a running pull, who pulls on their own, and what each one hears.

The leader here is a coroutine standing in for RemotePull (it calls ``serve_joiners`` where
the real one does, before done); the copies are real numpy copies between the "pools" (one
array each), so a joiner's destination is checked byte for byte.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from kvxfer.errors import DeadlineExceededError, UnavailableError
from kvxfer.proto import common_pb2
from kvxferd._transfers import TransferRecord
from kvxferd.handoff.shared import SharedReads

KEY = b"k" * 20


def _record(name: str) -> TransferRecord:
    return TransferRecord(name, "decode", common_pb2.TRANSFER_PATH_REMOTE, "offer-1")


class _Copies:
    """Copies block rows between arrays; fails into the arrays named in ``fail_into``."""

    def __init__(self) -> None:
        self.fail_into: set[int] = set()
        self.count = 0

    async def __call__(self, src: Any, src_ids: Any, dst: Any, dst_ids: Any) -> None:
        await asyncio.sleep(0)
        if id(dst) in self.fail_into:
            raise UnavailableError("that pool went away")
        dst[dst_ids] = src[src_ids]
        self.count += 1


async def _join(reads: SharedReads, name: str, dst: np.ndarray, ids: list[int], timeout_s: float = 10.0) -> Any:
    record = _record(name)
    async with asyncio.timeout(timeout_s) as deadline:
        joined = await reads.join(KEY, record, dst, np.array(ids), deadline)  # type: ignore[arg-type]
    return joined, record


async def test_joiners_get_the_leaders_blocks_and_are_counted() -> None:
    copies = _Copies()
    reads = SharedReads(copies)
    leader_dst = np.zeros((8, 4), np.uint8)
    leader = reads.lead(KEY, _record("lead"), leader_dst, np.array([1, 2]), readers=3)  # type: ignore[arg-type]
    a, b = np.zeros((8, 4), np.uint8), np.zeros((8, 4), np.uint8)
    ja = asyncio.create_task(_join(reads, "a", a, [5, 6]))
    jb = asyncio.create_task(_join(reads, "b", b, [0, 7]))
    await asyncio.sleep(0.01)
    leader_dst[[1, 2]] = [[1] * 4, [2] * 4]  # the wire transfer landed
    assert await leader.serve_joiners() == 2
    assert not ja.done()  # counted, waiting for the leader's outcome
    leader.ended(None)
    for (joined, record), dst, ids in ((await ja, a, [5, 6]), (await jb, b, [0, 7])):
        assert joined and record.transport == "shared" and record.committed
        np.testing.assert_array_equal(dst[ids], [[1] * 4, [2] * 4])


async def test_no_more_joiners_than_the_ticket_has_other_readers() -> None:
    reads = SharedReads(_Copies())
    reads.lead(KEY, _record("lead"), np.zeros((4, 1)), np.array([0]), readers=2)  # type: ignore[arg-type]
    first = asyncio.create_task(_join(reads, "a", np.zeros((4, 1)), [1]))
    await asyncio.sleep(0.01)
    joined, _ = await _join(reads, "b", np.zeros((4, 1)), [2])
    assert joined is False  # the one other reader is taken: this one pulls on its own
    first.cancel()


async def test_a_leader_that_fails_before_its_copies_sends_joiners_their_own_way() -> None:
    reads = SharedReads(_Copies())
    leader = reads.lead(KEY, _record("lead"), np.zeros((4, 1)), np.array([0]), readers=3)  # type: ignore[arg-type]
    waiting = asyncio.create_task(_join(reads, "a", np.zeros((4, 1)), [1]))
    await asyncio.sleep(0.01)
    leader.ended(UnavailableError("peer went away"))
    joined, record = await waiting
    assert joined is False and not record.committed
    assert (await _join(reads, "late", np.zeros((4, 1)), [2]))[0] is False  # the group is gone


async def test_a_failed_copy_sends_that_joiner_its_own_way_and_is_not_counted() -> None:
    copies = _Copies()
    reads = SharedReads(copies)
    leader = reads.lead(KEY, _record("lead"), np.ones((4, 1)), np.array([0]), readers=3)  # type: ignore[arg-type]
    bad, good = np.zeros((4, 1)), np.zeros((4, 1))
    copies.fail_into.add(id(bad))
    jbad = asyncio.create_task(_join(reads, "bad", bad, [1]))
    jgood = asyncio.create_task(_join(reads, "good", good, [1]))
    await asyncio.sleep(0.01)
    assert await leader.serve_joiners() == 1
    assert (await jbad)[0] is False
    leader.ended(None)
    assert (await jgood)[0] is True and good[1, 0] == 1


async def test_counted_joiners_share_the_leaders_failure_as_their_own_error() -> None:
    reads = SharedReads(_Copies())
    leader = reads.lead(KEY, _record("lead"), np.ones((4, 1)), np.array([0]), readers=2)  # type: ignore[arg-type]
    joiner = asyncio.create_task(_join(reads, "a", np.zeros((4, 1)), [1]))
    await asyncio.sleep(0.01)
    await leader.serve_joiners()
    failure = DeadlineExceededError("closed did not come")
    leader.ended(failure)
    with pytest.raises(DeadlineExceededError, match="the shared read lead failed") as raised:
        await joiner
    assert raised.value is not failure  # its own error: its transfer id is set on it, not on the leader's


async def test_a_joiner_whose_deadline_passes_while_waiting_leaves_the_group() -> None:
    copies = _Copies()
    reads = SharedReads(copies)
    leader = reads.lead(KEY, _record("lead"), np.ones((4, 1)), np.array([0]), readers=2)  # type: ignore[arg-type]
    dst = np.zeros((4, 1))
    with pytest.raises(TimeoutError):
        await _join(reads, "a", dst, [1], timeout_s=0.05)
    assert await leader.serve_joiners() == 0 and copies.count == 0 and dst[1, 0] == 0
    leader.ended(None)


async def test_a_cancel_during_the_copy_waits_for_it_and_is_then_too_late() -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def slow_copy(src: Any, src_ids: Any, dst: Any, dst_ids: Any) -> None:
        started.set()
        await release.wait()
        dst[dst_ids] = src[src_ids]

    reads = SharedReads(slow_copy)
    leader = reads.lead(KEY, _record("lead"), np.ones((4, 1)), np.array([0]), readers=2)  # type: ignore[arg-type]
    dst = np.zeros((4, 1))
    joiner = asyncio.create_task(_join(reads, "a", dst, [1]))
    await asyncio.sleep(0.01)
    serving = asyncio.create_task(leader.serve_joiners())
    await started.wait()
    joiner.cancel()
    await asyncio.sleep(0.01)
    assert not joiner.done()  # the leader is writing its destination: nobody hears of it yet
    release.set()
    assert await serving == 1
    leader.ended(None)
    joined, record = await joiner
    assert joined and record.committed and dst[1, 0] == 1
