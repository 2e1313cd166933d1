"""Push mode (engine.proto, Push and Receive): the router gives both engines a transfer id, the
decode engine expects it, the prefill engine pushes its blocks under it, and the decode daemon
moves them as for a pull, whichever side comes first. Real daemons, real UCX."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from bench.cluster import Cluster, Daemon
from bench.engine import blocks_of
from kvxfer.proto import admin_pb2, admin_pb2_grpc, common_pb2, peer_pb2, peer_pb2_grpc
from kvxfer_client import (
    AsyncKvxferClient,
    CancelledError,
    DeadlineExceededError,
    HostBuffer,
    Layout,
    Pool,
    ReleaseReason,
    UnavailableError,
)

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=32, block_bytes=8 << 10)


def _tid() -> str:
    return "push-" + secrets.token_hex(16)  # the router's unguessable id


async def _pools(p: AsyncKvxferClient, d: AsyncKvxferClient) -> tuple[Pool, Pool]:
    src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    for i, buf in enumerate(src):
        buf.array()[:] = np.random.default_rng(i).integers(0, 256, buf.size, dtype=np.uint8)
    dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    return await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT)


def _blocks(pool: Pool, ids: list[int]) -> list[bytes]:
    return blocks_of(LAYOUT, list(pool.buffers), ids)


async def _until(condition: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def _transfer(daemon: Daemon, transfer_id: str) -> admin_pb2.TransferInfo:
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        listed = stub.ListTransfers(admin_pb2.ListTransfersRequest(include_finished=True), timeout=5).transfers
    [row] = [t for t in listed if t.transfer_id == transfer_id]
    return row


@pytest.fixture
async def pair(cluster: Cluster) -> AsyncIterator[tuple[Daemon, Daemon]]:
    yield cluster.daemon("a", "--log-level", "debug"), cluster.daemon("b", "--log-level", "debug")


@pytest.mark.parametrize("first", ["receive", "push"])
@pytest.mark.parametrize("path", ["remote", "local"])
async def test_a_push_lands_whichever_side_comes_first(pair: tuple[Daemon, Daemon], path: str, first: str) -> None:
    a, b = pair
    decode_daemon = b if path == "remote" else a
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(decode_daemon.socket, engine_name="decode") as d,
    ):
        src, dst = await _pools(p, d)
        tid = _tid()
        receiving = None
        if first == "receive":
            receiving = asyncio.create_task(d.receive(tid, dst, [7, 8, 9], timeout_s=30))
            await _until(lambda: f"push.expected transfer_id={tid}" in decode_daemon.log(), "the receive never waited")
        pushed = await p.push(src, [3, 1, 2], tid, d.peer_address)
        assert pushed.mode == "push", pushed
        if receiving is None:
            receiving = asyncio.create_task(d.receive(tid, dst, [7, 8, 9], timeout_s=30))
        result = await receiving
        assert result.transfer_id == tid and result.path == path and result.bytes == 3 * LAYOUT.bytes_per_block
        assert _blocks(dst, [7, 8, 9]) == _blocks(src, [3, 1, 2])
        released = await p.wait_released(pushed.ticket.offer_id, 10)
        assert released.reason is ReleaseReason.PULLED and released.transfer_id == tid
        row = _transfer(decode_daemon, tid)
        assert row.mode == "push" and row.state == common_pb2.TRANSFER_STATE_SUCCEEDED, row
        assert row.mode_reason == "pushed by a", row
        if path == "remote":
            served = _transfer(a, tid)  # the offering side's record of the same transfer
            assert served.mode == "push" and tid in served.mode_reason, served
            matched = "matched=True" if first == "receive" else "matched=False"
            assert f"push.announced transfer_id={tid} peer_daemon_id=a {matched}" in b.log()


async def test_a_receive_can_take_only_the_pushed_blocks_it_lacks(pair: tuple[Daemon, Daemon]) -> None:
    """A decode engine holding a prefix in its cache receives the rest: positions in the
    pushed list, one destination block each, as a pull's offer_block_indices."""
    a, b = pair
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src, dst = await _pools(p, d)
        tid = _tid()
        receiving = asyncio.create_task(d.receive(tid, dst, [20, 21], timeout_s=30, offer_block_indices=[2, 3]))
        pushed = await p.push(src, [4, 5, 6, 7], tid, d.peer_address)
        assert pushed.mode == "push", pushed
        result = await receiving
        assert result.bytes == 2 * LAYOUT.bytes_per_block
        assert _blocks(dst, [20, 21]) == _blocks(src, [6, 7])
        with pytest.raises(Exception, match="2 offer_block_indices, 1 destination ids"):
            await d.receive(_tid(), dst, [9], offer_block_indices=[0, 1])


async def test_a_receive_whose_push_never_comes_fails_at_its_deadline_naming_it(
    pair: tuple[Daemon, Daemon],
) -> None:
    _, b = pair
    async with AsyncKvxferClient(b.socket, engine_name="decode") as d:
        dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        tid = _tid()
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=f"no push for transfer {tid} came within 1.0s"):
            await d.receive(tid, dst, [1], timeout_s=1.0)
        assert time.monotonic() - started < 5
        # A wrong destination fails at once, before any wait.
        with pytest.raises(Exception, match="receive destination"):
            await d.receive(_tid(), dst, [99], timeout_s=30)


async def test_cancelling_a_waiting_receive_ends_it_and_only_its_engine_may(pair: tuple[Daemon, Daemon]) -> None:
    _, b = pair
    async with (
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
        AsyncKvxferClient(b.socket, engine_name="other") as other,
    ):
        dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        tid = _tid()
        receiving = asyncio.create_task(d.receive(tid, dst, [1], timeout_s=60))
        await _until(lambda: f"push.expected transfer_id={tid}" in b.log(), "the receive never waited")
        with pytest.raises(Exception, match="another engine session"):
            await other.cancel(tid)
        assert not receiving.done()
        outcome = await d.cancel(tid)
        assert outcome.cancelled
        with pytest.raises(CancelledError, match=f"receive of transfer {tid} was cancelled"):
            await asyncio.wait_for(receiving, 10)


async def test_a_push_the_decode_daemon_cannot_take_falls_back_to_a_pull_saying_why(
    pair: tuple[Daemon, Daemon],
) -> None:
    a, b = pair
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src, dst = await _pools(p, d)
        # Nothing listens there: the offer stands, and the ticket is pulled instead.
        pushed = await p.push(src, [4], _tid(), "127.0.0.1:9")
        assert pushed.mode == "pull" and "127.0.0.1:9 did not take the push" in pushed.mode_reason
        await d.pull(pushed.ticket, dst, [5], timeout_s=30)
        assert _blocks(dst, [5]) == _blocks(src, [4])
        # The decode engine accepts this id only from another daemon: the push is refused.
        tid = _tid()
        receiving = asyncio.create_task(d.receive(tid, dst, [6], timeout_s=2, from_daemon_id="someone-else"))
        await _until(lambda: f"push.expected transfer_id={tid}" in b.log(), "the receive never waited")
        refused = await p.push(src, [4], tid, d.peer_address)
        assert refused.mode == "pull" and "expects a push from someone-else" in refused.mode_reason, refused
        with pytest.raises(DeadlineExceededError, match="no push from someone-else"):
            await receiving


async def test_a_held_push_expires_with_its_lease(pair: tuple[Daemon, Daemon]) -> None:
    a, b = pair
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src, dst = await _pools(p, d)
        tid = _tid()
        pushed = await p.push(src, [2], tid, d.peer_address, lease_s=0.5)
        assert pushed.mode == "push"
        assert (await p.wait_released(pushed.ticket.offer_id, 10)).reason is ReleaseReason.EXPIRED
        await _until(lambda: f"push.expired transfer_id={tid}" in b.log(), "the held push never expired")
        with pytest.raises(DeadlineExceededError, match=f"no push for transfer {tid}"):
            await d.receive(tid, dst, [3], timeout_s=0.5)


async def test_a_prefill_daemon_gone_after_its_push_fails_the_receive_typed_and_promptly(cluster: Cluster) -> None:
    a, b = cluster.daemon("a"), cluster.daemon("b")
    async with AsyncKvxferClient(b.socket, engine_name="decode") as d:
        p = await AsyncKvxferClient(a.socket, engine_name="prefill").connect()
        src, dst = await _pools(p, d)
        tid = _tid()
        assert (await p.push(src, [1, 2], tid, d.peer_address)).mode == "push"
        a.kill()
        started = time.monotonic()
        with pytest.raises(UnavailableError):
            await d.receive(tid, dst, [3, 4], timeout_s=20)
        assert time.monotonic() - started < 15
        assert b.proc is not None and b.proc.poll() is None


async def test_hostile_announcements_are_refused_typed(pair: tuple[Daemon, Daemon]) -> None:
    a, b = pair
    async with AsyncKvxferClient(a.socket, engine_name="prefill") as p:
        src = await p.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        ticket = (await p.offer(src, [1])).to_proto()
        async with grpc.aio.insecure_channel(b.info["peer_address"]) as channel:
            stub = peer_pb2_grpc.PeerServiceStub(channel)

            async def announce(**fields: object) -> grpc.StatusCode:
                args: dict[str, object] = {"transfer_id": _tid(), "ticket": ticket, "lease_s": 10}
                args.update(fields)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Announce(peer_pb2.PushAnnouncement(**args), timeout=10)
                return err.value.code()

            # A daemon that never said Hello to b.
            assert await announce(daemon_id="stranger") == grpc.StatusCode.FAILED_PRECONDITION
            assert await announce(daemon_id="a", ticket=common_pb2.Ticket()) == (grpc.StatusCode.INVALID_ARGUMENT)
            assert await announce(daemon_id="a", transfer_id="") == grpc.StatusCode.INVALID_ARGUMENT
            assert await announce(daemon_id="a", lease_s=-1) == grpc.StatusCode.INVALID_ARGUMENT
            # a has said Hello to b once it pushes; then someone claims to be a with a ticket of
            # another daemon (its address would make b dial elsewhere).
            async with AsyncKvxferClient(b.socket, engine_name="decode") as d:
                assert (await p.push(src, [2], _tid(), d.peer_address)).mode == "push"
            forged = common_pb2.Ticket()
            forged.CopyFrom(ticket)
            forged.peer_address = "10.0.0.1:1"
            code = await announce(daemon_id="a", ticket=forged)
            assert code == grpc.StatusCode.PERMISSION_DENIED
    assert b.proc is not None and b.proc.poll() is None, b.log()


async def test_a_push_to_a_decode_daemon_restarted_on_a_new_port_lands(cluster: Cluster) -> None:
    """The decode daemon restarts on another port: the prefill daemon's Hello to the new address
    (the push announcement) learns of its new UCX worker, and the bytes of the next push go to
    that worker, not over the endpoint the old daemon left behind (where they once waited out
    the pull's deadline)."""
    a, b = cluster.daemon("a"), cluster.daemon("b")
    async with AsyncKvxferClient(a.socket, engine_name="prefill") as p:
        for round_ in range(2):
            async with AsyncKvxferClient(b.socket, engine_name="decode") as d:
                if round_ == 0:
                    src, dst = await _pools(p, d)
                else:  # the restarted daemon: a new session, a new destination pool
                    dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
                tid = _tid()
                receiving = asyncio.create_task(d.receive(tid, dst, [4, 5], timeout_s=10))
                pushed = await p.push(src, [1, 2], tid, d.peer_address)
                assert pushed.mode == "push", pushed
                await receiving
                assert _blocks(dst, [4, 5]) == _blocks(src, [1, 2])
            if round_ == 0:
                b.terminate()
                b.start()  # --peer-listen 127.0.0.1:0: a new port, a new worker
    assert "ucx.endpoint_retired" in a.log() and "the peer came back with a new worker" in a.log()
