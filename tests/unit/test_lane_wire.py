"""The lane wire (kvxferd/dataplane/tcp_lanes.py) over real sockets: chunks of fragmented
plans arrive byte-exact on any number of lanes; a sender that brings another chunk than the
plan says, stops mid-chunk or goes silent fails the lane typed; the listener hands a
connection only to the transfer its hello names."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import numpy as np
import pytest

from kvxfer_client import UnavailableError
from kvxferd.dataplane.hostmem import MappedMemory
from kvxferd.dataplane.plan import RegionTable, build_plan
from kvxferd.dataplane.tcp_lanes import Lane, LaneListener, connect_lanes, receive_lane, run_lanes, send_lane

REGIONS = RegionTable.from_regions([(0, 0, 4096, 1024), (0, 1024, 4096, 3072), (1, 0, 2048, 2048)])


def _memory(seed: int | None) -> MappedMemory:
    sizes = (64 * 4096, 64 * 2048)
    if seed is None:
        return MappedMemory([np.zeros(n, dtype=np.uint8) for n in sizes])
    rng = np.random.default_rng(seed)
    return MappedMemory([rng.integers(0, 256, n, dtype=np.uint8) for n in sizes])


def _segments(memory: MappedMemory, ids: list[int]) -> list[bytes]:
    plan = build_plan(REGIONS, np.array(ids), 1 << 30)
    out = np.empty(plan.total_bytes, dtype=np.uint8)
    memory.gather(plan.chunks[0], out)
    return [out.tobytes()]


@pytest.mark.parametrize("count", [1, 3, 5])
async def test_every_chunk_lands_byte_exact_whatever_the_number_of_lanes(count: int) -> None:
    src, dst = _memory(1), _memory(None)
    src_ids, dst_ids = [5, 60, 3, 17, 40, 8, 9], [0, 1, 2, 30, 31, 63, 10]
    send_plan, recv_plan = build_plan(REGIONS, np.array(src_ids), 5000), build_plan(REGIONS, np.array(dst_ids), 5000)
    pairs = [socket.socketpair() for _ in range(count)]
    scratch = [np.empty(5000, dtype=np.uint8) for _ in range(2 * count)]

    def sender(sock: socket.socket, i: int) -> None:
        send_lane(Lane(sock, i, count, 5.0), send_plan, src, scratch[i])

    def receiver(sock: socket.socket, i: int) -> None:
        receive_lane(Lane(sock, i, count, 5.0), recv_plan, dst, scratch[count + i])

    await asyncio.gather(
        run_lanes(sender, [a for a, _ in pairs], "send"), run_lanes(receiver, [b for _, b in pairs], "receive")
    )
    assert _segments(dst, dst_ids) == _segments(src, src_ids)


def _feed(sock: socket.socket, data: bytes, then_close: bool) -> threading.Thread:
    def run() -> None:
        sock.sendall(data)
        if then_close:
            sock.close()

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize(
    ("sent", "close", "error"),
    [
        (struct.pack("<II", 1, 5000), False, "brought chunk 1 of 5000 bytes; chunk 0 of 5000 was due"),
        (struct.pack("<II", 0, 1 << 30), False, "chunk 0 of 1073741824 bytes"),
        (struct.pack("<II", 0, 5000) + b"x" * 100, True, "closed a TCP lane mid-transfer"),
        (b"", False, "timed out"),
    ],
)
async def test_a_sender_that_strays_from_the_plan_fails_the_lane_typed(sent: bytes, close: bool, error: str) -> None:
    """Another chunk or size than the plan says, a close mid-chunk, silence: UnavailableError,
    and nothing of a refused chunk is written."""
    dst = _memory(None)
    plan = build_plan(REGIONS, np.array([0, 1, 2]), 5000)
    ours, theirs = socket.socketpair()
    feeding = _feed(theirs, sent, close)

    def receiver(sock: socket.socket, i: int) -> None:
        receive_lane(Lane(sock, i, 1, 0.3), plan, dst, np.empty(5000, dtype=np.uint8))

    with pytest.raises(UnavailableError, match=error):
        await run_lanes(receiver, [ours], "receive")
    feeding.join()
    theirs.close()
    if not close:
        assert not any(a.any() for a in dst.arrays)


async def test_the_listener_hands_a_connection_only_to_the_transfer_its_hello_names() -> None:
    listener = LaneListener(hello_timeout_s=0.5)
    listener.start("127.0.0.1:0")
    port = listener.port
    try:
        lanes = listener.expect(b"n" * 16, 2)
        other = listener.expect(b"o" * 16, 1)
        socks = await connect_lanes("127.0.0.1", port, b"n" * 16, 2, 5.0)
        wrong = await connect_lanes("127.0.0.1", port, b"x" * 16, 1, 5.0)  # no transfer waits for it
        got = await lanes.connected(5.0)
        assert len(got) == 2
        with pytest.raises(UnavailableError, match="0 of 1 TCP lanes connected"):
            await other.connected(0.2)
        loop = asyncio.get_running_loop()
        wrong[0].setblocking(False)
        assert await asyncio.wait_for(loop.sock_recv(wrong[0], 16), 5) == b""  # closed unanswered
        again = await connect_lanes("127.0.0.1", port, b"n" * 16, 2, 5.0)  # its lanes are taken
        again[0].setblocking(False)
        assert await asyncio.wait_for(loop.sock_recv(again[0], 16), 5) == b""
        for s in socks + wrong + again:
            s.close()
    finally:
        await listener.close()
