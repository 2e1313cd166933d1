"""Offers, leases, sessions and errors, seen from an engine using the SDK in this process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest

from bench.cluster import Cluster
from kvxfer_client import (
    AsyncKvxferClient,
    HostBuffer,
    IncompatibleError,
    InvalidRequestError,
    KvxferClient,
    Layout,
    NotFoundError,
    PermissionDeniedError,
    Pool,
    ReleaseReason,
    Ticket,
)

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=32, block_bytes=512)


@dataclass
class Engine:
    client: AsyncKvxferClient
    pool: Pool


async def engine_on(daemon_socket: str, name: str, layout: Layout = LAYOUT, seed: int | None = None) -> Engine:
    client = await AsyncKvxferClient(daemon_socket, engine_name=name).connect()
    buffers = [HostBuffer.create(size) for size in layout.buffer_sizes()]
    if seed is not None:
        rng = np.random.default_rng(seed)
        for b in buffers:
            b.array()[:] = rng.integers(0, 256, b.size, dtype=np.uint8)
    return Engine(client, await client.register_pool(buffers, layout))


@pytest.fixture
async def prefill(two_daemons: Cluster) -> AsyncIterator[Engine]:
    e = await engine_on(two_daemons.daemons[0].socket, "prefill", seed=1)
    yield e
    await e.client.close()


@pytest.fixture(params=["local", "remote"])
async def decode(request: pytest.FixtureRequest, two_daemons: Cluster) -> AsyncIterator[Engine]:
    daemon = two_daemons.daemons[0 if request.param == "local" else 1]
    e = await engine_on(daemon.socket, f"decode-{request.param}")
    yield e
    await e.client.close()


async def test_an_unpulled_offer_expires_with_its_lease(prefill: Engine) -> None:
    ticket = await prefill.client.offer(prefill.pool, [1, 2, 3], lease_s=0.3)
    t0 = time.monotonic()
    event = await prefill.client.wait_released(ticket.offer_id, timeout_s=5)
    assert event.reason is ReleaseReason.EXPIRED
    assert 0.25 <= time.monotonic() - t0 < 3


async def test_a_pull_after_expiry_is_not_found(prefill: Engine, decode: Engine) -> None:
    ticket = await prefill.client.offer(prefill.pool, [4], lease_s=0.2)
    await prefill.client.wait_released(ticket.offer_id, timeout_s=5)
    with pytest.raises(NotFoundError, match="expired: its lease ended"):
        await decode.client.pull(ticket, decode.pool, [4])


async def test_a_wrong_token_is_denied_and_the_offer_survives(prefill: Engine, decode: Engine) -> None:
    ticket = await prefill.client.offer(prefill.pool, [5, 6])
    forged = Ticket.from_dict({**ticket.to_dict(), "token": "00" * 16})
    with pytest.raises(PermissionDeniedError, match="wrong token"):
        await decode.client.pull(forged, decode.pool, [0, 1])
    result = await decode.client.pull(ticket, decode.pool, [0, 1])
    assert result.bytes == 2 * LAYOUT.bytes_per_block
    assert (await prefill.client.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.PULLED


async def test_an_incompatible_layout_is_refused_before_any_byte_moves(
    two_daemons: Cluster, prefill: Engine, decode: Engine
) -> None:
    other = Layout.paged_kv(num_layers=2, num_blocks=32, block_bytes=256)
    mismatched = await engine_on(decode.client.socket_path, "decode-other", other)
    try:
        ticket = await prefill.client.offer(prefill.pool, [7])
        with pytest.raises(IncompatibleError, match="fingerprint"):
            await mismatched.client.pull(ticket, mismatched.pool, [0])
        # The refused pull left the offer alone: the right destination still gets it.
        await decode.client.pull(ticket, decode.pool, [3])
    finally:
        await mismatched.client.close()


@pytest.mark.parametrize(
    ("dst_ids", "error", "message"),
    [
        ([40], InvalidRequestError, "outside the pool"),
        ([1, 1], InvalidRequestError, "ticket holds 1 blocks|repeat"),
        ([], InvalidRequestError, "non-empty"),
    ],
)
async def test_bad_destination_ids_are_refused_and_lose_nothing(
    prefill: Engine, decode: Engine, dst_ids: list[int], error: type[Exception], message: str
) -> None:
    ticket = await prefill.client.offer(prefill.pool, [8])
    with pytest.raises(error, match=message):
        await decode.client.pull(ticket, decode.pool, dst_ids)
    await decode.client.pull(ticket, decode.pool, [9])


async def test_offer_validation(prefill: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="outside the pool"):
        await prefill.client.offer(prefill.pool, [32])
    with pytest.raises(InvalidRequestError, match="repeat"):
        await prefill.client.offer(prefill.pool, [3, 3])
    with pytest.raises(InvalidRequestError, match="lease_s"):
        await prefill.client.offer(prefill.pool, [3], lease_s=1e9)
    with pytest.raises(NotFoundError, match="no pool"):
        await prefill.client.offer("pool-nope", [3])


async def test_withdrawn_offer_is_released_as_cancelled(prefill: Engine) -> None:
    ticket = await prefill.client.offer(prefill.pool, [10])
    await prefill.client.release(ticket.offer_id)
    assert (await prefill.client.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.CANCELLED


async def test_deregistering_a_pool_releases_its_offers(two_daemons: Cluster) -> None:
    e = await engine_on(two_daemons.daemons[0].socket, "short-lived")
    try:
        ticket = await e.client.offer(e.pool, [1])
        assert await e.client.deregister_pool(e.pool) == 1
        assert (await e.client.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.POOL_GONE
    finally:
        await e.client.close()


def test_the_blocking_client_does_a_local_handoff(two_daemons: Cluster) -> None:
    socket = two_daemons.daemons[0].socket
    with KvxferClient(socket, engine_name="sync-prefill") as p, KvxferClient(socket, engine_name="sync-decode") as d:
        src = HostBuffer.create(LAYOUT.buffer_sizes()[0])
        src.array()[:] = np.arange(src.size, dtype=np.uint64).astype(np.uint8)
        srcs = [src] + [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()[1:]]
        dsts = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        ppool, dpool = p.register_pool(srcs, LAYOUT), d.register_pool(dsts, LAYOUT)
        ticket = p.offer(ppool, [31])
        result = d.pull(ticket.to_json(), dpool, [0])
        assert result.path == "local" and result.bytes == LAYOUT.bytes_per_block
        k = src.array()[31 * 512 : 32 * 512]
        assert np.array_equal(dsts[0].array()[0:512], k)
        assert p.wait_released(ticket.offer_id, 5).reason is ReleaseReason.PULLED


def test_engine_disconnect_deregisters_its_pools(two_daemons: Cluster) -> None:
    daemon = two_daemons.daemons[1]
    engine = two_daemons.engine(daemon, "doomed")
    engine("pool", shape={"layers": 1, "blocks": 8, "block_bytes": 4096})
    engine("offer", requests=[[1, 2]], lease_s=600)

    def pools_of(session: str) -> int:
        import json
        import subprocess
        import sys

        out = subprocess.run(
            [sys.executable, "-m", "kvxfer_client._ctl", "--socket", daemon.socket, "--json", "status"],
            capture_output=True,
            text=True,
            check=True,
        )
        status = json.loads(out.stdout)
        return sum(1 for p in status["pools"] if p["engine"] == "doomed")

    assert pools_of(engine.session_id) == 1
    engine.kill()
    deadline = time.monotonic() + 5
    while pools_of(engine.session_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pools_of(engine.session_id) == 0
