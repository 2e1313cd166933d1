"""Engines on one daemon cannot reach each other's memory: host memory is mapped only from
descriptors the engine opened itself (never by name), and pools, offers and their release
belong to the session that created them."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator

import grpc
import pytest

from bench.cluster import Cluster, Daemon
from kvxfer.proto import admin_pb2, admin_pb2_grpc, common_pb2, engine_pb2, engine_pb2_grpc
from kvxfer_client import (
    AsyncKvxferClient,
    HostBuffer,
    InvalidRequestError,
    Layout,
    PermissionDeniedError,
    ReleaseReason,
    Ticket,
)

LAYOUT = Layout.contiguous(num_blocks=16, block_bytes=4096)


@pytest.fixture(scope="module")
def daemon() -> AsyncIterator[Daemon]:
    with Cluster() as cluster:
        yield cluster.daemon("a")


async def _pool(client: AsyncKvxferClient, fill: int = 0) -> object:
    buf = HostBuffer.create(LAYOUT.buffer_sizes()[0])
    buf.array()[:] = fill
    return await client.register_pool([buf], LAYOUT)


async def test_a_pool_named_after_memory_the_engine_cannot_open_is_refused(daemon: Daemon) -> None:
    # A root-only segment: the daemon (root here) could open it, the engine must not get it.
    name = "kvxfer-secret-" + secrets.token_hex(4)
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        os.pwrite(fd, b"secret", 0)
        async with AsyncKvxferClient(daemon.socket, engine_name="member") as member:
            req = engine_pb2.RegisterPoolRequest(
                session_id=member.session_id,
                buffers=[common_pb2.BufferSpec(kind=common_pb2.MEMORY_KIND_HOST_SHM, size=4096, shm_name=name)],
                layout=Layout.contiguous(num_blocks=1, block_bytes=4096).to_proto(),
            )
            async with grpc.aio.insecure_channel("unix:" + daemon.socket) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await engine_pb2_grpc.EngineServiceStub(channel).RegisterPool(req, timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "file descriptor" in (refused.value.details() or "")
                pools = await admin_pb2_grpc.AdminServiceStub(channel).ListPools(admin_pb2.ListPoolsRequest())
                assert not [p for p in pools.pools if p.engine_name == "member"]
    finally:
        os.close(fd)
        os.unlink(path)


async def test_host_buffers_leave_nothing_in_dev_shm_and_register_again_from_their_descriptor(daemon: Daemon) -> None:
    buf = HostBuffer.create(LAYOUT.buffer_sizes()[0], prefix="kvxfer-iso")
    assert not os.path.exists(os.path.join("/dev/shm", buf.name))
    async with AsyncKvxferClient(daemon.socket, engine_name="twice") as client:
        first = await client.register_pool([buf], LAYOUT)
        second = await client.register_pool([buf], LAYOUT)
        assert first.pool_id != second.pool_id


async def test_one_engine_cannot_offer_release_pull_into_or_deregister_anothers_pool(daemon: Daemon) -> None:
    async with (
        AsyncKvxferClient(daemon.socket, engine_name="victim") as victim,
        AsyncKvxferClient(daemon.socket, engine_name="intruder") as intruder,
    ):
        victim_pool = await _pool(victim, fill=7)
        intruder_pool = await _pool(intruder)
        ticket = await victim.offer(victim_pool, [1], lease_s=60)
        with pytest.raises(PermissionDeniedError):
            await intruder.offer(victim_pool, [2])
        with pytest.raises(PermissionDeniedError):
            await intruder.release(ticket.offer_id)
        with pytest.raises(PermissionDeniedError):
            await intruder.deregister_pool(victim_pool)
        own_ticket = await intruder.offer(intruder_pool, [3])
        with pytest.raises(PermissionDeniedError):
            await intruder.pull(own_ticket, victim_pool, [4])
        # The victim's offer is untouched: its own release works and says so.
        await victim.release(ticket.offer_id)
        assert (await victim.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.CANCELLED


async def test_requests_without_a_session_are_refused_and_operators_see_labels_not_session_ids(daemon: Daemon) -> None:
    async with AsyncKvxferClient(daemon.socket, engine_name="owner") as owner:
        pool = await _pool(owner)
        async with grpc.aio.insecure_channel("unix:" + daemon.socket) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Offer(engine_pb2.OfferRequest(pool_id=pool.pool_id, block_ids=[1]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            listed = await admin_pb2_grpc.AdminServiceStub(channel).ListPools(admin_pb2.ListPoolsRequest())
        shown = next(p for p in listed.pools if p.pool_id == pool.pool_id)
        assert shown.session_id and shown.session_id != owner.session_id


async def test_a_ticket_whose_byte_count_disagrees_with_its_blocks_is_refused(daemon: Daemon) -> None:
    async with (
        AsyncKvxferClient(daemon.socket, engine_name="p") as p,
        AsyncKvxferClient(daemon.socket, engine_name="d") as d,
    ):
        src, dst = await _pool(p, fill=3), await _pool(d)
        ticket = await p.offer(src, [1, 2], lease_s=60)
        tampered = Ticket(**{**ticket.__dict__, "total_bytes": 1})
        with pytest.raises(InvalidRequestError, match="total_bytes 1"):
            await d.pull(tampered, dst, [5, 6])
        await d.pull(ticket, dst, [5, 6])  # the offer was not touched
        assert (await p.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.PULLED
