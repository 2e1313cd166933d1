"""A pull that runs out of time fails in bounded time and writes nothing afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import numpy as np
import pytest

from bench.cluster import Cluster, Daemon
from kvxfer.proto import admin_pb2, admin_pb2_grpc
from kvxfer_client import AsyncKvxferClient, DeadlineExceededError, HostBuffer, KvxferError, Layout, ReleaseReason
from kvxfer_client._client import PULL_ANSWER_MARGIN_S
from kvxferd.dataplane.sends import SEND_LINGER_S
from kvxferd.dataplane.ucp_iov import CANCEL_CONFIRM_S

LAYOUT = Layout.paged_kv(num_layers=8, num_blocks=1024, block_bytes=16 << 10)  # 256 MiB per pool


def offer_state(daemon: Daemon, offer_id: str) -> str:
    """``offered``, ``pulling`` or ``gone``, as the daemon's AdminService lists it."""
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        offers = admin_pb2_grpc.AdminServiceStub(channel).ListOffers(admin_pb2.ListOffersRequest(), timeout=5)
    return next((o.state for o in offers.offers if o.offer_id == offer_id), "gone")


@pytest.mark.parametrize("iov", [True, False], ids=["iov-receive", "staged-receive"])
async def test_a_timed_out_remote_pull_stops_writing_before_it_returns(cluster: Cluster, iov: bool) -> None:
    # 64 KiB chunks (4 fragmented segments each) one at a time: a 128 MiB pull takes a while.
    slow = ["--chunk-bytes", "65536", "--window", "1"]
    a = cluster.daemon("a", *slow)
    b = cluster.daemon("b", *slow, *([] if iov else ["--no-ucx-iov-receive"]))
    p = await AsyncKvxferClient(a.socket, engine_name="p").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="d").connect()
    src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    for buf in src:
        buf.array()[:] = np.random.default_rng(1).integers(1, 256, buf.size, dtype=np.uint8)
    dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    ppool, dpool = await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT)
    # Warm up (Hello, UCX endpoint) and time a full pull of the same size: the deadlines
    # below are fractions of it, so they fall inside the data transfer however loaded the
    # machine is. A deadline that passes before the prefill daemon claims the offer leaves
    # the offer pullable instead (nothing moved, nothing to release): try a later one.
    warm = await p.offer(ppool, list(range(0, 1024, 2)))
    t0 = time.monotonic()
    await d.pull(warm, dpool, list(range(1, 1024, 2)), timeout_s=60)
    full_s = time.monotonic() - t0
    for buf in dst:
        buf.array()[:] = 0  # so that a late chunk write would show
    ticket = await p.offer(ppool, list(range(0, 1024, 2)))

    released = None
    for deadline_s in (max(0.02, full_s * f) for f in (0.1, 0.25, 0.5)):
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await d.pull(ticket, dpool, list(range(1, 1024, 2)), timeout_s=deadline_s)
        assert time.monotonic() - t0 < 2.0

        # Whatever landed before the failure stays as it is: no late chunk writes afterwards.
        snapshot = [buf.array().copy() for buf in dst]
        await asyncio.sleep(1.0)
        assert all(np.array_equal(s, buf.array()) for s, buf in zip(snapshot, dst, strict=True))
        if offer_state(a, ticket.offer_id) == "offered":
            continue  # never claimed: the offer is still pullable, try a later deadline
        released = await p.wait_released(ticket.offer_id, timeout_s=5)
        break
    assert released is not None, f"no deadline up to {full_s / 2:.3f} s fell inside the {full_s:.3f} s transfer"
    assert released.reason is ReleaseReason.FAILED
    # Both daemons stay usable: a fresh offer of the same blocks goes through in full.
    again = await p.offer(ppool, [0, 2])
    result = await d.pull(again, dpool, [5, 7], timeout_s=30)
    assert result.bytes == 2 * LAYOUT.bytes_per_block
    await p.close()
    await d.close()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_a_prefill_daemon_whose_puller_died_mid_transfer_releases_the_offer_and_goes_quiet(
    cluster: Cluster,
) -> None:
    # Sends to a dead peer never complete on shared memory (no peer-failure detection there):
    # they must not keep the prefill daemon's UCX progress spinning once their linger is over.
    slow = ["--chunk-bytes", "65536", "--window", "2"]
    a = cluster.daemon("a", *slow, "--peer-timeout-s", "2")
    b = cluster.daemon("b", *slow)
    p = await AsyncKvxferClient(a.socket, engine_name="p").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="d").connect()
    src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    ppool, dpool = await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT)
    ticket = await p.offer(ppool, list(range(0, 1024, 2)))
    pulling = asyncio.create_task(d.pull(ticket, dpool, list(range(1, 1024, 2)), timeout_s=60))
    for _ in range(500):  # until the prefill daemon is sending
        if offer_state(a, ticket.offer_id) == "pulling":
            break
        await asyncio.sleep(0.01)
    assert offer_state(a, ticket.offer_id) == "pulling", "the transfer never started"
    b.kill()
    with pytest.raises(KvxferError):
        await pulling
    released = await p.wait_released(ticket.offer_id, timeout_s=15)
    assert released.reason is ReleaseReason.FAILED
    assert a.proc is not None
    await asyncio.sleep(SEND_LINGER_S + 0.5)
    before = _cpu_seconds(a.proc.pid)
    await asyncio.sleep(2.0)
    used = _cpu_seconds(a.proc.pid) - before
    assert used < 0.5, f"the prefill daemon used {used:.2f} CPU seconds in 2 s after its puller died"
    await p.close()


async def test_a_pull_whose_sender_froze_gets_the_daemons_answer_not_a_bare_rpc_deadline(cluster: Cluster) -> None:
    """A receive UCX cannot confirm cancelled costs the decode daemon CANCEL_CONFIRM_S after
    the pull's deadline; the engine must still get the daemon's answer (with
    ``may_still_write``), which decides whether it may reuse the destination blocks."""
    assert PULL_ANSWER_MARGIN_S > CANCEL_CONFIRM_S + 1.0
    # Small chunks, two in flight: a transfer of a few hundred ms, mostly inside a message.
    slow = ["--chunk-bytes", "262144", "--window", "2"]
    a, b = cluster.daemon("a", *slow), cluster.daemon("b", *slow)
    p = await AsyncKvxferClient(a.socket, engine_name="p").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="d").connect()
    src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    ppool, dpool = await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT)
    await d.pull(await p.offer(ppool, [0]), dpool, [1], timeout_s=30)  # Hello and endpoint first
    ticket = await p.offer(ppool, list(range(0, 1024, 2)))
    deadline_s = 2.0
    t0 = time.monotonic()
    pulling = asyncio.create_task(d.pull(ticket, dpool, list(range(1, 1024, 2)), timeout_s=deadline_s))
    for _ in range(500):  # until the prefill daemon is sending
        if offer_state(a, ticket.offer_id) == "pulling":
            break
        await asyncio.sleep(0.01)
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)  # mid-transfer: its sends stop making progress
    try:
        with pytest.raises(DeadlineExceededError) as failure:
            await pulling
        elapsed = time.monotonic() - t0
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    assert f"did not finish within {deadline_s}s" in str(failure.value), "the RPC deadline ended the call first"
    assert elapsed < deadline_s + PULL_ANSWER_MARGIN_S
    if failure.value.may_still_write:
        assert elapsed >= deadline_s + CANCEL_CONFIRM_S - 0.5
    # The thawed prefill daemon sees its puller gone and releases the offer as failed.
    released = await p.wait_released(ticket.offer_id, timeout_s=30)
    assert released.reason is ReleaseReason.FAILED
    await p.close()
    await d.close()
