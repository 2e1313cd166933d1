"""Leases with a decode-side heartbeat, cancel from either side, idempotent pull retries."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest

from bench.cluster import Cluster, Daemon
from kvxfer_client import (
    AlreadyExistsError,
    AsyncKvxferClient,
    CancelledError,
    HostBuffer,
    KvxferError,
    Layout,
    NotFoundError,
    OfferExpiredError,
    OfferTakenError,
    PermissionDeniedError,
    Pool,
    ReleaseReason,
    Ticket,
)

LAYOUT = Layout.paged_kv(num_layers=4, num_blocks=256, block_bytes=64 << 10)  # 128 MiB per pool


@dataclass
class Pair:
    prefill: AsyncKvxferClient
    decode: AsyncKvxferClient
    src: Pool
    dst: Pool
    dst_buffers: list[HostBuffer]
    decode_daemon: Daemon


@pytest.fixture
async def pair(two_daemons: Cluster) -> AsyncIterator[Pair]:
    a, b = two_daemons.daemons
    p = await AsyncKvxferClient(a.socket, engine_name="p").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="d").connect()
    src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    for i, buf in enumerate(src):
        buf.array()[:] = np.random.default_rng(i).integers(0, 256, buf.size, dtype=np.uint8)
    dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    yield Pair(p, d, await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT), dst, b)
    await p.close()
    await d.close()


async def test_a_heartbeat_keeps_a_short_lease_alive_across_daemons(pair: Pair) -> None:
    ticket = await pair.prefill.offer(pair.src, [1, 2, 3], lease_s=0.6)
    for _ in range(6):  # 1.8 s of waiting, three times the lease
        remaining = await pair.decode.extend_lease(ticket, 0.6)
        assert 0.4 < remaining <= 0.6
        await asyncio.sleep(0.3)
    result = await pair.decode.pull(ticket, pair.dst, [7, 8, 9])
    assert result.bytes == 3 * LAYOUT.bytes_per_block
    assert (await pair.prefill.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.PULLED


async def test_without_the_heartbeat_the_lease_expires_and_the_pull_finds_nothing(pair: Pair) -> None:
    ticket = await pair.prefill.offer(pair.src, [4], lease_s=0.3)
    assert (await pair.prefill.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.EXPIRED
    with pytest.raises(OfferExpiredError, match="expired: its lease ended"):
        await pair.decode.extend_lease(ticket, 1.0)
    with pytest.raises(OfferExpiredError, match="expired: its lease ended"):  # typed across daemons
        await pair.decode.pull(ticket, pair.dst, [4])
    forged = Ticket(**{**ticket.__dict__, "token": b"\1" * 16})
    with pytest.raises(NotFoundError, match="no offer") as refused:  # without its token, nothing is told
        await pair.decode.pull(forged, pair.dst, [4])
    assert not isinstance(refused.value, OfferExpiredError)
    # Counted apart from refusals and transport failures: operators read it as capacity.
    # A pull's metrics and log line follow its answer by a turn of the daemon's loop: wait, bounded.
    b = pair.decode_daemon
    deadline = time.monotonic() + 10
    while True:
        metrics = await asyncio.to_thread(_scrape, b.info["metrics_address"])
        expired = [
            line
            for line in metrics.splitlines()
            if line.startswith("kvxfer_transfers_total") and 'reason="expired"' in line
        ]
        if (expired and "reason=expired" in b.log()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert expired and float(expired[0].rsplit(" ", 1)[1]) == 1.0, expired
    assert "reason=expired" in b.log()


async def test_a_heartbeat_with_a_wrong_token_is_refused_and_changes_nothing(pair: Pair) -> None:
    ticket = await pair.prefill.offer(pair.src, [5], lease_s=0.5)
    forged = Ticket(**{**ticket.__dict__, "token": b"\0" * 16})
    with pytest.raises(PermissionDeniedError):
        await pair.decode.extend_lease(forged, 60)
    assert (await pair.prefill.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.EXPIRED


async def test_a_retried_pull_with_the_same_transfer_id_moves_nothing_twice(pair: Pair) -> None:
    ticket = await pair.prefill.offer(pair.src, [10, 11])
    first = await pair.decode.pull(ticket, pair.dst, [20, 21], transfer_id="retry-1")
    landed = [b.array().copy() for b in pair.dst_buffers]
    # The engine lost the answer and retries: same answer, and the destination is not written
    # again (an engine may already have started using those blocks).
    pair.dst_buffers[0].array()[:] = 0
    again = await pair.decode.pull(ticket, pair.dst, [20, 21], transfer_id="retry-1")
    assert (again.transfer_id, again.bytes) == (first.transfer_id, first.bytes)
    assert not pair.dst_buffers[0].array().any()
    assert all(np.array_equal(x.array(), y) for x, y in zip(pair.dst_buffers[1:], landed[1:], strict=True))
    # The same id for another destination is refused.
    with pytest.raises(AlreadyExistsError):
        await pair.decode.pull(ticket, pair.dst, [30, 31], transfer_id="retry-1")


PAUSED = ("--chunk-bytes", str(1 << 20), "--window", "2", "--fault-injection", "--faults")


async def _paused_pair(cluster: Cluster, fault: str) -> tuple[Pair, Daemon]:
    """A pair whose prefill daemon pauses at ``fault``: a cancel or abort lands mid-transfer."""
    a = cluster.daemon("a", *PAUSED, fault)
    b = cluster.daemon("b")
    p = await AsyncKvxferClient(a.socket, engine_name="p").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="d").connect()
    src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    return Pair(p, d, await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT), dst, b), a


async def _paused(daemon: Daemon, hits: int = 1) -> None:
    deadline = time.monotonic() + 20
    while daemon.log().count("fault.hit") < hits:
        assert time.monotonic() < deadline, daemon.log()[-3000:]
        await asyncio.sleep(0.01)


async def test_the_decode_side_cancels_its_pull_and_learns_that_nothing_writes_any_more(cluster: Cluster) -> None:
    # The prefill daemon sends one chunk, then pauses with the rest due: the cancel lands
    # while bytes are moving, and must stop every write before the engine is told.
    pair, a = await _paused_pair(cluster, "after_chunk_sent:0=pause:10")
    ticket = await pair.prefill.offer(pair.src, list(range(0, 256, 2)))  # 64 MiB
    pulling = asyncio.create_task(pair.decode.pull(ticket, pair.dst, list(range(128)), transfer_id="cancel-d"))
    await _paused(a)
    outcome = await pair.decode.cancel("cancel-d")
    assert outcome.cancelled
    assert outcome.may_still_write is False
    with pytest.raises(CancelledError):
        await pulling
    released = await pair.prefill.wait_released(ticket.offer_id, 15)
    assert released.reason is ReleaseReason.FAILED
    snapshot = [b.array().copy() for b in pair.dst_buffers]
    await asyncio.sleep(0.5)
    assert all(np.array_equal(b.array(), s) for b, s in zip(pair.dst_buffers, snapshot, strict=True))
    await pair.prefill.close()
    await pair.decode.close()


@pytest.mark.parametrize("fault", ["after_accepted=pause:10", "after_chunk_sent:0=pause:10"])
async def test_the_prefill_side_aborts_a_pull_of_its_offer_and_the_decode_side_is_told(
    cluster: Cluster, fault: str
) -> None:
    # The abort lands after accepted (no byte sent yet) or mid-data; either way the puller
    # hears of it at once and no transfer is left behind on either daemon.
    pair, a = await _paused_pair(cluster, fault)
    ticket = await pair.prefill.offer(pair.src, list(range(1, 256, 2)))
    t0 = time.monotonic()
    pulling = asyncio.create_task(
        pair.decode.pull(ticket, pair.dst, list(range(128, 256)), transfer_id="abort-p", timeout_s=20)
    )
    await _paused(a)
    outcome = await pair.prefill.cancel("abort-p")  # the prefill daemon serves this transfer id
    assert outcome.cancelled
    with pytest.raises(KvxferError):
        await pulling
    assert time.monotonic() - t0 < 5.0, "the puller was not told of the abort"
    assert (await pair.prefill.wait_released(ticket.offer_id, 10)).reason is ReleaseReason.FAILED
    for daemon in cluster.daemons:
        assert await _active_transfers(daemon.info["metrics_address"]) == 0
    await pair.prefill.close()
    await pair.decode.close()


async def _active_transfers(metrics_address: str, settle_s: float = 2.0) -> float:
    """``kvxfer_transfers_active`` summed over roles, once it reaches 0 or ``settle_s`` passes."""
    deadline = time.monotonic() + settle_s
    while True:
        text = await asyncio.to_thread(_scrape, metrics_address)
        active = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("kvxfer_transfers_active{")
        )
        if active == 0 or time.monotonic() > deadline:
            return active
        await asyncio.sleep(0.1)


def _scrape(metrics_address: str) -> str:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


async def test_the_loser_of_two_concurrent_pulls_of_one_offer_always_hears_the_same_thing(pair: Pair) -> None:
    """Two pulls of one ticket race (whether the winner is still pulling or already done when
    the loser arrives): the loser gets OfferTakenError naming the other transfer, every time."""
    for round_ in range(20):
        ticket = await pair.prefill.offer(pair.src, [round_ % 8])
        pulls = [pair.decode.pull(ticket, pair.dst, [16 + i]) for i in range(2)]
        results = await asyncio.gather(*pulls, return_exceptions=True)
        lost = [r for r in results if isinstance(r, BaseException)]
        assert len(lost) == 1, results
        assert isinstance(lost[0], OfferTakenError) and "by another transfer" in str(lost[0]), repr(lost[0])
