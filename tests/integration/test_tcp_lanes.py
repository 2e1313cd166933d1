"""TCP lanes (kvxferd/dataplane/tcp_lanes.py) between two real daemons: host blocks move over
several TCP connections at once where UCX would carry them over TCP, byte-exact, with the same
steps, outcomes and integrity checks as over UCX; the lane port serves no stranger; a daemon
lost mid-lane fails the transfer typed and in bounded time, on both sides."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest

from bench.cluster import Cluster, Daemon
from kvxfer_client import AsyncKvxferClient, HostBuffer, Layout
from kvxfer_client._proto import admin_pb2, admin_pb2_grpc

NO_DIRECT = {"KVXFERD_SAME_HOST_DIRECT_READ": "false"}
LANES = ("--tcp-lanes", "always", "--chunk-bytes", str(1 << 20))
# 8 layers of K and V, 64 KiB blocks: a fragmented (b16-like) pull of 24 blocks is 12 MiB.
LAYOUT = Layout.paged_kv(num_layers=8, num_blocks=64, block_bytes=64 << 10)


def _transfers(daemon: Daemon) -> list[admin_pb2.TransferInfo]:
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        return list(stub.ListTransfers(admin_pb2.ListTransfersRequest(include_finished=True), timeout=5).transfers)


def _row(daemon: Daemon, transfer_id: str) -> admin_pb2.TransferInfo:
    [row] = [t for t in _transfers(daemon) if t.transfer_id == transfer_id]
    return row


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def _filled(layout: Layout, seed: int) -> list[HostBuffer]:
    buffers = [HostBuffer.create(s) for s in layout.buffer_sizes()]
    for i, buf in enumerate(buffers):
        buf.array()[:] = np.random.default_rng(seed + i).integers(0, 256, buf.size, dtype=np.uint8)
    return buffers


def _blocks(layout: Layout, buffers: list[HostBuffer], ids: list[int]) -> list[bytes]:
    out = []
    for r in layout.regions:
        arr = buffers[r.buffer_index].array()
        out += [bytes(arr[r.offset + b * r.block_stride :][: r.block_bytes]) for b in ids]
    return out


@pytest.mark.parametrize("lanes", [1, 4])
async def test_fragmented_blocks_land_byte_exact_over_the_lanes(cluster: Cluster, lanes: int) -> None:
    a = cluster.daemon("a", *LANES, "--tcp-lane-count", str(lanes), env=NO_DIRECT)
    b = cluster.daemon("b", *LANES, "--tcp-lane-count", str(lanes), "--integrity", "full", env=NO_DIRECT)
    src_ids = [int(x) for x in np.random.default_rng(1).permutation(64)[:24]]
    dst_ids = [int(x) for x in np.random.default_rng(2).permutation(64)[:24]]
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src_bufs = _filled(LAYOUT, 10)
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        src, dst = await p.register_pool(src_bufs, LAYOUT), await d.register_pool(dst_bufs, LAYOUT)
        result = await d.pull(await p.offer(src, src_ids), dst, dst_ids, transfer_id="lanes-1")
        assert result.bytes == 24 * LAYOUT.bytes_per_block
        assert _blocks(LAYOUT, dst_bufs, dst_ids) == _blocks(LAYOUT, src_bufs, src_ids)
        for daemon in (a, b):
            assert _row(daemon, "lanes-1").transport == f"tcp-lanes:{lanes}"
