"""Layer-wise streaming (engine.proto, OfferRequest.layers and LayersReady): the prefill engine
offers before its KV is written and says layer by layer how far it got; each pull moves every
layer once written and reports success only after the last has landed. Real daemons; the
remote pulls over UCX and over same-host direct reads, and the local copy."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from bench.cluster import Cluster, Daemon
from kvxfer_client import (
    AsyncKvxferClient,
    CancelledError,
    DeadlineExceededError,
    HostBuffer,
    InvalidRequestError,
    KvxferError,
    Layout,
    NotFoundError,
    PermissionDeniedError,
    Pool,
    ReleaseReason,
)

LAYERS = 4
BLOCKS = 16
# One buffer per layer (K then V): layer g of the prefill pool is buffer g.
LAYOUT = Layout.paged_kv(num_layers=LAYERS, num_blocks=BLOCKS, block_bytes=64 << 10)
SRC_IDS, DST_IDS = [5, 1, 9, 2, 14, 7], [0, 3, 6, 8, 10, 12]
#: Every layer-wise transfer streams here, however small (the defaults send < 64 MiB whole).
STREAM_ALL = ("--layerwise-min-bytes", "1", "--layerwise-batch-bytes", "1")


def _segments(pool: Pool, layer: int, ids: list[int]) -> bytes:
    """Layer ``layer``'s K and V segments of blocks ``ids``, in order."""
    arr = pool.buffers[layer].array()
    half = BLOCKS * (64 << 10)
    return b"".join(
        bytes(arr[kv * half + b * (64 << 10) : kv * half + (b + 1) * (64 << 10)]) for kv in (0, 1) for b in ids
    )


def _write_layer(pool: Pool, layer: int) -> None:
    arr = pool.buffers[layer].array()
    arr[:] = np.random.default_rng(100 + layer).integers(0, 256, arr.size, dtype=np.uint8)


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


@pytest.fixture
async def daemons(cluster: Cluster, request: pytest.FixtureRequest) -> AsyncIterator[tuple[Daemon, Daemon]]:
    direct = "true" if getattr(request, "param", "ucx") == "direct" else "false"
    env = {"KVXFERD_SAME_HOST_DIRECT_READ": direct}
    yield cluster.daemon("a", *STREAM_ALL, env=env), cluster.daemon("b", *STREAM_ALL, env=env)


async def _engines(a: Daemon, decode_on: Daemon) -> tuple[AsyncKvxferClient, AsyncKvxferClient, Pool, Pool]:
    p = await AsyncKvxferClient(a.socket, engine_name="prefill").connect()
    d = await AsyncKvxferClient(decode_on.socket, engine_name="decode").connect()
    src = await p.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
    dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
    return p, d, src, dst


@pytest.mark.parametrize(
    ("daemons", "path", "mode"),
    [
        ("ucx", "remote", "pull"),
        ("direct", "remote", "pull"),
        ("ucx", "local", "pull"),
        ("ucx", "remote", "push"),
        ("direct", "local", "push"),
    ],
    indirect=["daemons"],
)
async def test_each_layer_moves_once_written_and_the_pull_ends_only_after_the_last(
    daemons: tuple[Daemon, Daemon], path: str, mode: str
) -> None:
    a, b = daemons
    p, d, src, dst = await _engines(a, b if path == "remote" else a)
    try:
        # Offered before a single layer is written (the pool holds zeros).
        tid = f"{mode}-" + secrets.token_hex(16)
        if mode == "pull":
            ticket = await p.offer(src, SRC_IDS, layers=LAYERS)
            moving = asyncio.create_task(d.pull(ticket, dst, DST_IDS, timeout_s=60, transfer_id=tid))
        else:
            moving = asyncio.create_task(d.receive(tid, dst, DST_IDS, timeout_s=60))
            pushed = await p.push(src, SRC_IDS, tid, d.peer_address, layers=LAYERS)
            assert pushed.mode == "push", pushed
            ticket = pushed.ticket
        for layer in range(LAYERS - 1):
            _write_layer(src, layer)
            await p.layers_ready(ticket, layer + 1)
            # The decode engine hears the layer landed while later ones are still unwritten, and
            # its bytes are there: the move is under way, and not over (its last layer does not
            # exist yet).
            assert await d.wait_layers(tid, layer + 1, timeout_s=10) == layer + 1
            assert _segments(dst, layer, DST_IDS) == _segments(src, layer, SRC_IDS), f"layer {layer}"
            assert not moving.done(), await moving
        _write_layer(src, LAYERS - 1)
        await p.layers_ready([ticket], LAYERS)
        result = await asyncio.wait_for(moving, 30)
        assert result.bytes == len(SRC_IDS) * LAYOUT.bytes_per_block
        for layer in range(LAYERS):
            assert _segments(dst, layer, DST_IDS) == _segments(src, layer, SRC_IDS), f"layer {layer}"
        assert (await p.wait_released(ticket.offer_id, 10)).reason is ReleaseReason.PULLED
    finally:
        await p.close()
        await d.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("lost", ["engine", "daemon"])
@pytest.mark.parametrize("daemons", ["ucx", "direct"], indirect=True)
async def test_a_layer_wise_transfer_that_loses_its_prefill_engine_or_daemon_mid_stream_fails_typed_and_promptly(
    daemons: tuple[Daemon, Daemon], lost: str, mode: str
) -> None:
    """Layer 0 landed, layer 1 not written (the window held by the engine, not by a sleep):
    the prefill engine exits or its daemon is killed. The decode side's pull (or receive)
    fails typed well within its deadline, its blocks are never reported complete, and the
    surviving daemons are left with no offer, transfer or staging buffer of it."""
    a, b = daemons
    p, d, src, dst = await _engines(a, b)
    try:
        if mode == "pull":
            ticket = await p.offer(src, SRC_IDS, layers=LAYERS)
            moving = asyncio.create_task(d.pull(ticket, dst, DST_IDS, timeout_s=60))
        else:
            tid = secrets.token_hex(16)
            moving = asyncio.create_task(d.receive(tid, dst, DST_IDS, timeout_s=60))
            ticket = (await p.push(src, SRC_IDS, tid, d.peer_address, layers=LAYERS)).ticket
        _write_layer(src, 0)
        await p.layers_ready(ticket, 1)
        await _until(lambda: _segments(dst, 0, DST_IDS) == _segments(src, 0, SRC_IDS), "layer 0 never landed")
        if lost == "engine":
            await p.close()  # the prefill engine exits mid-request: its memory may be gone
        else:
            a.kill()
        started = time.monotonic()
        with pytest.raises(KvxferError) as failed:
            await asyncio.wait_for(moving, 30)
        assert not isinstance(failed.value, DeadlineExceededError), failed.value
        assert time.monotonic() - started < 15
        assert b.proc is not None and b.proc.poll() is None
        for survivor in [b] if lost == "daemon" else [a, b]:
            left = await survivor.settled()
            assert (left.active_offers, left.active_transfers) == (0, 0), (survivor.name, left)
            assert (left.staging_send_in_use, left.staging_receive_in_use) == (0, 0), (survivor.name, left)
    finally:
        await d.close()
        await p.close()


@pytest.mark.parametrize("daemons", ["ucx"], indirect=True)
async def test_a_layer_wise_pull_cancelled_or_left_unwritten_ends_typed_and_never_complete(
    daemons: tuple[Daemon, Daemon],
) -> None:
    a, b = daemons
    p, d, src, dst = await _engines(a, b)
    try:
        ticket = await p.offer(src, SRC_IDS, layers=LAYERS)
        moving = asyncio.create_task(d.pull(ticket, dst, DST_IDS, timeout_s=60, transfer_id="cancel-me"))
        _write_layer(src, 0)
        await p.layers_ready(ticket, 2)
        await _until(lambda: _segments(dst, 0, DST_IDS) == _segments(src, 0, SRC_IDS), "layer 0 never landed")
        assert (await d.cancel("cancel-me")).cancelled
        with pytest.raises(CancelledError):
            await asyncio.wait_for(moving, 30)
        assert (await p.wait_released(ticket.offer_id, 10)).reason is ReleaseReason.FAILED

        # The engine never writes the last layer: the pull ends at its deadline, not complete.
        ticket = await p.offer(src, SRC_IDS, layers=LAYERS)
        await p.layers_ready(ticket, LAYERS - 1)
        with pytest.raises(DeadlineExceededError):
            await d.pull(ticket, dst, DST_IDS, timeout_s=1.5)
        assert (await p.wait_released(ticket.offer_id, 10)).reason is ReleaseReason.FAILED
    finally:
        await p.close()
        await d.close()


@pytest.mark.parametrize("daemons", ["ucx"], indirect=True)
async def test_layers_ready_refuses_other_sessions_unknown_offers_and_uneven_layers(
    daemons: tuple[Daemon, Daemon],
) -> None:
    a, _ = daemons
    p, other, src, _dst = await _engines(a, a)
    try:
        with pytest.raises(InvalidRequestError, match="do not divide the pool's 8 regions"):
            await p.offer(src, [1], layers=3)
        ticket = await p.offer(src, [1], layers=LAYERS)
        with pytest.raises(PermissionDeniedError):
            await other.layers_ready(ticket, 1)
        with pytest.raises(NotFoundError):
            await p.layers_ready(["off-" + "0" * 32], 1)
        await p.layers_ready(ticket, 99)  # more than it has: all written
        await p.release(ticket.offer_id)
        await p.layers_ready(ticket, 1)  # an ended offer is passed over
    finally:
        await p.close()
        await other.close()
