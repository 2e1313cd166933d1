"""10,000 offers, 10% never pulled: every one ends (pulled or expired), and a second round of
the same leaves the daemon's memory where the first left it."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc

from bench.cluster import Cluster, Daemon
from kvxfer.proto import admin_pb2, admin_pb2_grpc
from kvxfer_client import AsyncKvxferClient, HostBuffer, Layout, Pool
from kvxfer_client._client import MAX_QUEUED_EVENTS

OFFERS = 10_000
NEVER_PULLED = OFFERS // 10
LAYOUT = Layout.paged_kv(num_layers=1, num_blocks=1024, block_bytes=256)
SHORT_LEASE_S = 2.0  # the offers nobody pulls
LONG_LEASE_S = 120.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def status(daemon: Daemon) -> admin_pb2.StatusResponse:
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        return admin_pb2_grpc.AdminServiceStub(channel).Status(admin_pb2.StatusRequest(), timeout=5)


async def one_round(prefill: AsyncKvxferClient, decode: AsyncKvxferClient, src: Pool, dst: Pool) -> Counter[str]:
    sem = asyncio.Semaphore(64)

    async def offer(i: int) -> str:
        async with sem:
            lease = SHORT_LEASE_S if i < NEVER_PULLED else LONG_LEASE_S
            return (await prefill.offer(src, [i % 1024], lease_s=lease)).to_json()

    tickets = await asyncio.gather(*(offer(i) for i in range(OFFERS)))

    async def pull(i: int, ticket: str) -> None:
        async with sem:
            await decode.pull(ticket, dst, [i % 1024])

    await asyncio.gather(*(pull(i, t) for i, t in enumerate(tickets[NEVER_PULLED:])))
    offer_ids = [t.split('"offer_id":"')[1].split('"')[0] for t in tickets]
    events = await asyncio.gather(*(prefill.wait_released(o, SHORT_LEASE_S + 30) for o in offer_ids))
    return Counter(e.reason.value for e in events)


async def test_ten_thousand_offers_all_end_and_memory_returns_to_its_baseline(cluster: Cluster) -> None:
    daemon = cluster.daemon("a", "--max-offers", str(OFFERS))
    assert daemon.proc is not None
    prefill = await AsyncKvxferClient(daemon.socket, engine_name="p").connect()
    decode = await AsyncKvxferClient(daemon.socket, engine_name="d").connect()
    src = await prefill.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
    dst = await decode.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
    before = rss_bytes(daemon.proc.pid)

    t0 = time.monotonic()
    first = await one_round(prefill, decode, src, dst)
    assert first == {"pulled": OFFERS - NEVER_PULLED, "expired": NEVER_PULLED}
    baseline = rss_bytes(daemon.proc.pid)  # after one full round: caches and pools warmed up
    second = await one_round(prefill, decode, src, dst)
    assert second == first
    after = rss_bytes(daemon.proc.pid)

    # The prefill engine only ever called wait_released(): its event queue stayed bounded.
    assert prefill.events_dropped == 2 * OFFERS - MAX_QUEUED_EVENTS

    s = status(daemon)
    assert (s.active_offers, s.active_transfers, s.lease_expiries) == (0, 0, 2 * NEVER_PULLED)
    growth = after - baseline
    print(
        f"\n{2 * OFFERS} offers in {time.monotonic() - t0:.1f}s; daemon RSS {before >> 20} MiB at start, "
        f"{baseline >> 20} MiB after round 1, {after >> 20} MiB after round 2 ({growth / 2**20:+.1f} MiB)"
    )
    assert growth < 8 << 20
    await prefill.close()
    await decode.close()
