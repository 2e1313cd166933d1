"""Both sides of a remote pull agree on its outcome in every interleaving of sent, done,
closed, cancel and deadlines (peer.proto, "Outcomes"): before sent either side can fail it;
from sent the puller decides; at done it has succeeded, and nothing the offerer does after
reading done changes that. Each window is hit every time through the daemons'
fault-injection points, never by sleeping and hoping."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from bench.cluster import Cluster, Daemon
from kvxfer.proto import admin_pb2, admin_pb2_grpc, common_pb2
from kvxfer_client import (
    AsyncKvxferClient,
    CancelledError,
    HostBuffer,
    KvxferError,
    Layout,
    ReleaseReason,
    UnavailableError,
)

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=32, block_bytes=64 << 10)


def _with_faults(spec: str, *more: str) -> list[str]:
    return ["--fault-injection", "--faults", spec, "--peer-timeout-s", "1", *more]


async def _wait_for_log(daemon: Daemon, text: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in daemon.log():
        assert time.monotonic() < deadline, f"{text!r} never appeared in {daemon.name}'s log"
        await asyncio.sleep(0.02)


async def _admin_cancel(daemon: Daemon, transfer_id: str) -> admin_pb2.AdminCancelResponse:
    """An operator's cancel (engines may cancel only transfers touching their own pools)."""
    async with grpc.aio.insecure_channel("unix:" + daemon.socket) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        return await stub.Cancel(admin_pb2.AdminCancelRequest(id=transfer_id), timeout=30)


async def _pull(prefill: Daemon, decode: Daemon, timeout_s: float, transfer_id: str = "t-1") -> tuple[object, object]:
    """Offer on ``prefill``, pull on ``decode``; returns (pull result or error, release reason)."""
    async with (
        AsyncKvxferClient(prefill.socket, engine_name="p") as p,
        AsyncKvxferClient(decode.socket, engine_name="d") as d,
    ):
        src = await p.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        ticket = await p.offer(src, [1, 2, 3], lease_s=60)
        try:
            outcome: object = await d.pull(ticket, dst, [4, 5, 6], transfer_id=transfer_id, timeout_s=timeout_s)
        except KvxferError as exc:
            outcome = exc
        released = await p.wait_released(ticket.offer_id, 30)
        return outcome, released.reason


def test_fault_points_are_refused_unless_enabled_at_start(cluster: Cluster) -> None:
    with pytest.raises(RuntimeError, match="fault_injection is off"):
        cluster.daemon("a", "--faults", "before_done=fail")


async def test_the_puller_succeeds_at_done_without_waiting_for_closed(cluster: Cluster) -> None:
    # The offerer stalls 12 s between reading done (and releasing the offer as pulled) and
    # saying closed, past the transfer's 8 s deadline: the engine has its answer at done. (The
    # deadline leaves a loaded machine time to reach done: at 2 s, CI's once did not, and the
    # failed pull left the offer unreleased.)
    a = cluster.daemon("a", *_with_faults("after_done_read=pause:12"))
    b = cluster.daemon("b", "--peer-timeout-s", "1")
    started = time.monotonic()
    outcome, reason = await _pull(a, b, timeout_s=8, transfer_id="t-quiet")
    assert not isinstance(outcome, Exception), outcome
    assert reason is ReleaseReason.PULLED
    assert time.monotonic() - started < 12, "the pull waited for the offerer's closed"
    await _wait_for_log(a, "transfer_id=t-quiet")
    assert b.transfer("t-quiet").state == common_pb2.TRANSFER_STATE_SUCCEEDED


async def test_an_offerer_failing_after_it_read_done_changes_nothing(cluster: Cluster) -> None:
    a = cluster.daemon("a", *_with_faults("after_done_read=fail"))
    b = cluster.daemon("b", "--peer-timeout-s", "1")
    outcome, reason = await _pull(a, b, timeout_s=20, transfer_id="t-after")
    assert not isinstance(outcome, Exception), outcome
    assert reason is ReleaseReason.PULLED
    await _wait_for_log(a, "transfer.done")
    assert a.transfer("t-after").state == common_pb2.TRANSFER_STATE_SUCCEEDED


async def test_a_prefill_side_cancel_before_sent_fails_both_sides(cluster: Cluster) -> None:
    a = cluster.daemon("a", *_with_faults("before_sent=pause:3"))
    b = cluster.daemon("b", "--peer-timeout-s", "1")
    pulling = asyncio.create_task(_pull(a, b, timeout_s=20, transfer_id="t-cancel"))
    await _wait_for_log(a, "point=before_sent")
    assert (await _admin_cancel(a, "t-cancel")).cancelled
    outcome, reason = await pulling
    assert isinstance(outcome, CancelledError), outcome
    assert reason is ReleaseReason.FAILED


async def test_a_prefill_side_cancel_once_sent_is_on_its_way_is_too_late_and_both_sides_succeed(
    cluster: Cluster,
) -> None:
    a = cluster.daemon("a", "--peer-timeout-s", "1")
    b = cluster.daemon("b", *_with_faults("before_done=pause:2"))
    pulling = asyncio.create_task(_pull(a, b, timeout_s=20, transfer_id="t-sent"))
    await _wait_for_log(b, "point=before_done")
    with pytest.raises(grpc.aio.AioRpcError) as nothing:  # the puller decides now
        await _admin_cancel(a, "t-sent")
    assert nothing.value.code() == grpc.StatusCode.NOT_FOUND
    outcome, reason = await pulling
    assert not isinstance(outcome, Exception), outcome
    assert reason is ReleaseReason.PULLED


async def test_a_decode_side_cancel_before_done_fails_both_sides(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--peer-timeout-s", "1")
    b = cluster.daemon("b", *_with_faults("before_done=pause:3"))
    pulling = asyncio.create_task(_pull(a, b, timeout_s=20, transfer_id="t-mine"))
    await _wait_for_log(b, "point=before_done")
    assert (await _admin_cancel(b, "t-mine")).cancelled
    outcome, reason = await pulling
    assert isinstance(outcome, CancelledError), outcome
    assert reason is ReleaseReason.FAILED


async def test_a_decode_side_cancel_after_done_is_too_late_and_both_sides_succeed(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--peer-timeout-s", "1")
    b = cluster.daemon("b", *_with_faults("before_closed_read=pause:2"))
    pulling = asyncio.create_task(_pull(a, b, timeout_s=20, transfer_id="t-late"))
    await _wait_for_log(b, "point=before_closed_read")
    with pytest.raises(grpc.aio.AioRpcError) as nothing:  # succeeded: not a cancellable transfer
        await _admin_cancel(b, "t-late")
    assert nothing.value.code() == grpc.StatusCode.NOT_FOUND
    outcome, reason = await pulling
    assert not isinstance(outcome, Exception), outcome
    assert reason is ReleaseReason.PULLED


async def test_a_peer_whose_sends_keep_failing_gets_a_new_endpoint_and_pulls_recover(cluster: Cluster) -> None:
    # Three sends in a row fail on the offering side's data plane, then the plane is healthy.
    a = cluster.daemon("a", *_with_faults("after_chunk_sent:0=fail:3"))
    b = cluster.daemon("b", "--peer-timeout-s", "1")
    for attempt in range(3):
        outcome, reason = await _pull(a, b, timeout_s=20, transfer_id=f"t-fail-{attempt}")
        assert isinstance(outcome, UnavailableError), outcome
        assert reason is ReleaseReason.FAILED
    # Each failure retired the offerer's endpoint, and the puller says Hello again before
    # each next pull (the first Hello and two after failures so far).
    assert a.log().count("ucx.endpoint_retired") == 3
    assert a.log().count("peer.hello") == 3
    outcome, reason = await _pull(a, b, timeout_s=20, transfer_id="t-after")
    assert not isinstance(outcome, Exception), outcome
    assert reason is ReleaseReason.PULLED
    assert a.log().count("peer.hello") == 4
