"""TCP lanes (kvxferd/dataplane/tcp_lanes.py) between two real daemons: host blocks move over
several TCP connections at once where UCX would carry them over TCP, byte-exact, with the same
steps, outcomes and integrity checks as over UCX; the lane port serves no stranger; a daemon
lost mid-lane fails the transfer typed and in bounded time, on both sides."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import numpy as np
import pytest

from bench.cluster import Cluster
from kvxfer_client import AsyncKvxferClient, HostBuffer, KvGeometry, Layout, ModelInfo, ReleaseReason, UnavailableError

NO_DIRECT = {"KVXFERD_SAME_HOST_DIRECT_READ": "false"}
LANES = ("--tcp-lanes", "always", "--chunk-bytes", str(1 << 20))
# 8 layers of K and V, 64 KiB blocks: a fragmented (b16-like) pull of 24 blocks is 12 MiB.
LAYOUT = Layout.paged_kv(num_layers=8, num_blocks=64, block_bytes=64 << 10)


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
            assert daemon.transfer("lanes-1").transport == f"tcp-lanes:{lanes}"


@pytest.mark.parametrize("env", ["tcp-only", "shared-memory"])
async def test_auto_mode_takes_lanes_only_where_ucx_would_use_tcp(cluster: Cluster, env: str) -> None:
    """tcp_lanes: auto (the default): UCX restricted to TCP (UCX_TLS=tcp, as between hosts
    without RDMA) sends host blocks over lanes and says why in the log, once; with shared
    memory in common UCX carries them."""
    extra = {"UCX_TLS": "tcp"} if env == "tcp-only" else {}
    a = cluster.daemon("a", env={**NO_DIRECT, **extra})
    b = cluster.daemon("b", env={**NO_DIRECT, **extra})
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src_bufs = _filled(LAYOUT, 20)
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        src, dst = await p.register_pool(src_bufs, LAYOUT), await d.register_pool(dst_bufs, LAYOUT)
        for i in range(2):
            result = await d.pull(await p.offer(src, [1, 2, 3]), dst, [7, 8, 9], transfer_id=f"auto-{i}")
            assert _blocks(LAYOUT, dst_bufs, [7, 8, 9]) == _blocks(LAYOUT, src_bufs, [1, 2, 3])
        if env == "tcp-only":
            assert result.transport == "tcp-lanes:4", result
            assert b.log().count("transport.tcp_lanes") == 1, b.log()  # once per peer
        else:
            assert result.transport.startswith("ucx:") and "tcp" not in result.transport, result
            assert "transport.tcp_lanes" not in b.log()


async def test_a_remapped_partial_pull_goes_over_the_lanes_checked_where_it_lands(cluster: Cluster) -> None:
    """Another head order and a partial pull (offer_block_indices) over lanes: each side cuts
    the stream by its own plan, the chunks are the same; full integrity checks every window."""
    a = cluster.daemon("a", *LANES, "--integrity", "full", env=NO_DIRECT)
    b = cluster.daemon("b", *LANES, env=NO_DIRECT)
    model = ModelInfo("m", "bf16", 16)
    src_layout, dst_layout = (
        Layout.paged_kv(
            num_layers=4, num_blocks=16, block_bytes=64 << 10, model=model, geometry=KvGeometry(16, 8, 512, o)
        )
        for o in ("HND", "NHD")
    )
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src = await p.register_pool(_filled(src_layout, 30), src_layout)
        dst = await d.register_pool([HostBuffer.create(s) for s in dst_layout.buffer_sizes()], dst_layout)
        ticket = await p.offer(src, [9, 3, 5, 11, 2])
        result = await d.pull(ticket, dst, [0, 1, 2], offer_block_indices=[1, 2, 4], transfer_id="remap-lanes")
        assert result.mapping and result.transport == "tcp-lanes:4", result
        row = b.transfer("remap-lanes")
        assert (row.integrity_mode, row.integrity_blocks, row.integrity_result) == ("full", 3, "ok"), row
        # The same blocks over UCX, into another daemon's pool: the same bytes land.
        plain = cluster.daemon("c", env=NO_DIRECT)
        async with AsyncKvxferClient(plain.socket, engine_name="decode-ucx") as u:
            check = await u.register_pool([HostBuffer.create(s) for s in dst_layout.buffer_sizes()], dst_layout)
            by_ucx = await u.pull(await p.offer(src, [3, 5, 2]), check, [0, 1, 2], transfer_id="remap-ucx")
            assert not by_ucx.transport.startswith("tcp-lanes"), by_ucx
            got = [bytes(b.array()) for b in dst.buffers]
            assert got == [bytes(b.array()) for b in check.buffers]


async def test_the_lane_port_serves_no_stranger(cluster: Cluster) -> None:
    """Connections that bring garbage, a hello naming no transfer, nothing at all (held past
    the hello timeout) or a flood get closed without a byte; the daemon serves on."""
    a = cluster.daemon("a", *LANES, "--peer-timeout-s", "1", env=NO_DIRECT)
    b = cluster.daemon("b", *LANES, env=NO_DIRECT)
    host, port = a.info["lanes_address"].rsplit(":", 1)
    assert (await a.settled()).lanes_address == a.info["lanes_address"]  # kvxferctl status shows it
    strangers = []
    for payload in (
        b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100,
        b"KVL1" + bytes(20),
        b"KVL1\x00\x00\x04\x00" + b"n" * 16,
        b"",
    ):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(payload)
        strangers.append(s)
    flood = [socket.create_connection((host, int(port)), timeout=5) for _ in range(80)]
    for s in strangers:
        try:
            got = s.recv(64)
        except ConnectionResetError:  # closed with its unread garbage still queued
            got = b""
        assert got == b"", "a stranger was sent bytes"  # closed: refused or timed out
    for s in strangers + flood:
        s.close()
    assert "lanes.refused" in a.log() and "a hello naming no transfer" in a.log() and "no hello within" in a.log()
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src_bufs = _filled(LAYOUT, 40)
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        src, dst = await p.register_pool(src_bufs, LAYOUT), await d.register_pool(dst_bufs, LAYOUT)
        result = await d.pull(await p.offer(src, [4, 5]), dst, [4, 5])
        assert result.transport == "tcp-lanes:4" and _blocks(LAYOUT, dst_bufs, [4, 5]) == _blocks(
            LAYOUT, src_bufs, [4, 5]
        )


@pytest.mark.parametrize("lost", ["offering", "receiving"])
async def test_a_daemon_lost_mid_lane_fails_the_transfer_typed_on_the_other_side(cluster: Cluster, lost: str) -> None:
    """Lane 0 has sent its first chunk and waits at a fault point (the window held by the
    fault, not a sleep); then one daemon is killed. The pull fails typed well within its
    deadline (or the offer is released as failed), and the survivor holds no offer,
    transfer or staging buffer of it."""
    hold = ("--fault-injection", "--faults", "after_chunk_sent:0=pause:60")
    a = cluster.daemon("a", *LANES, *hold, env=NO_DIRECT)
    b = cluster.daemon("b", *LANES, env=NO_DIRECT)
    p = await AsyncKvxferClient(a.socket, engine_name="prefill").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="decode").connect()
    try:
        src = await p.register_pool(_filled(LAYOUT, 50), LAYOUT)
        dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        ticket = await p.offer(src, list(range(24)))
        moving = asyncio.create_task(d.pull(ticket, dst, list(range(24)), timeout_s=60))
        await _until(lambda: "point=after_chunk_sent:0" in a.log(), "lane 0 never reached the fault point")
        started = time.monotonic()
        if lost == "offering":
            a.kill()
            with pytest.raises(UnavailableError):
                await asyncio.wait_for(moving, 30)
            survivor = b
        else:
            b.kill()
            released = await p.wait_released(ticket.offer_id, 30)
            assert released.reason is ReleaseReason.FAILED, released
            moving.cancel()
            survivor = a
        assert time.monotonic() - started < 15
        left = await survivor.settled()
        assert (left.active_offers, left.active_transfers) == (0, 0), left
        assert (left.staging_send_in_use, left.staging_receive_in_use) == (0, 0), left
    finally:
        await d.close()
        await p.close()
