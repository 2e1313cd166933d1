"""A Transfers stream's writer sends the messages that are ready together in one write,
in order, within bounds; the reader takes a batch apart one level deep."""

from __future__ import annotations

import asyncio

from kvxfer.batching import MAX_BATCH, MAX_BATCH_BYTES, Batches, unbatched
from kvxfer.proto import peer_pb2


def _queued(*messages: peer_pb2.TransferServerMessage) -> asyncio.Queue[peer_pb2.TransferServerMessage]:
    queue: asyncio.Queue[peer_pb2.TransferServerMessage] = asyncio.Queue()
    for msg in messages:
        queue.put_nowait(msg)
    return queue


def _sent(i: int, sums: int = 0) -> peer_pb2.TransferServerMessage:
    block_sums = peer_pb2.BlockSums(mode="full", positions=range(sums), sums=range(sums))
    return peer_pb2.TransferServerMessage(transfer_id=f"t-{i}", sent=peer_pb2.TransferSent(bytes=i, sums=block_sums))


async def _writes(queue: asyncio.Queue[peer_pb2.TransferServerMessage]) -> list[list[str]]:
    batches, writes = Batches(queue), []
    while not queue.empty() or batches._held is not None:
        writes.append([m.transfer_id for m in unbatched(await batches.next())])
    return writes


def test_messages_ready_together_go_in_one_write_in_their_order() -> None:
    writes = asyncio.run(_writes(_queued(*(_sent(i) for i in range(MAX_BATCH + 3)))))
    assert [len(w) for w in writes] == [MAX_BATCH + 1, 2]  # the first, and MAX_BATCH behind it
    assert [t for w in writes for t in w] == [f"t-{i}" for i in range(MAX_BATCH + 3)]


def test_a_batch_stays_under_its_byte_bound_and_a_large_message_goes_next() -> None:
    big = 60_000  # sums of 60,000 blocks: more than half the bound
    assert MAX_BATCH_BYTES / 2 < _sent(1, big).ByteSize() < MAX_BATCH_BYTES
    writes = asyncio.run(_writes(_queued(_sent(0), _sent(1, big), _sent(2, big), _sent(3))))
    assert writes == [["t-0", "t-1"], ["t-2", "t-3"]]


def test_a_lone_message_goes_as_it_is() -> None:
    (write,) = asyncio.run(_writes(_queued(_sent(7))))
    assert write == ["t-7"]


def test_the_reader_takes_one_level_and_ignores_what_a_peer_nests_deeper() -> None:
    inner = _sent(1)
    inner.more.append(_sent(2))  # a peer nesting batches: not read
    outer = _sent(0)
    outer.more.append(inner)
    assert [m.transfer_id for m in unbatched(outer)] == ["t-0", "t-1"]
