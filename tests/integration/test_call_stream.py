"""EngineService.Calls: offers and pulls multiplexed on one stream behave exactly like the
unary calls (results, errors, deadlines, cancellation), answer in completion order, and a
client falls back to unary calls on a daemon without the stream."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest

from bench.cluster import Cluster, Daemon
from bench.engine import blocks_of
from kvxfer.proto import admin_pb2, admin_pb2_grpc, common_pb2, engine_pb2, engine_pb2_grpc
from kvxfer_client import (
    AsyncKvxferClient,
    DeadlineExceededError,
    HostBuffer,
    InvalidRequestError,
    KvxferError,
    Layout,
    PermissionDeniedError,
    Pool,
)

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=64, block_bytes=64 << 10)  # 16 MiB per pool


@dataclass
class Engines:
    daemon: Daemon
    prefill: AsyncKvxferClient
    decode: AsyncKvxferClient
    src: Pool
    dst: Pool
    src_buffers: list[HostBuffer]
    dst_buffers: list[HostBuffer]


async def _engines(daemon: Daemon, call_stream: bool) -> Engines:
    p = await AsyncKvxferClient(daemon.socket, engine_name="p", call_stream=call_stream).connect()
    d = await AsyncKvxferClient(daemon.socket, engine_name="d", call_stream=call_stream).connect()
    src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    for i, buf in enumerate(src):
        buf.array()[:] = np.random.default_rng(i).integers(0, 256, buf.size, dtype=np.uint8)
    dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    src_pool, dst_pool = await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT)
    return Engines(daemon, p, d, src_pool, dst_pool, src, dst)


@pytest.fixture
async def engines(two_daemons: Cluster) -> AsyncIterator[Engines]:
    e = await _engines(two_daemons.daemons[0], call_stream=True)
    yield e
    await e.prefill.close()
    await e.decode.close()


def _blocks(buffers: list[HostBuffer], ids: list[int]) -> list[bytes]:
    return blocks_of(LAYOUT, buffers, ids)


def _transfer_state(daemon: Daemon, transfer_id: str) -> str:
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        listed = stub.ListTransfers(admin_pb2.ListTransfersRequest(include_finished=True), timeout=5).transfers
    state = next((t.state for t in listed if t.transfer_id == transfer_id), None)
    return "absent" if state is None else common_pb2.TransferState.Name(state)


@pytest.mark.parametrize("call_stream", [True, False], ids=["stream", "unary"])
async def test_offers_pulls_and_their_errors_are_the_same_on_the_stream_and_as_unary_calls(
    two_daemons: Cluster, call_stream: bool
) -> None:
    e = await _engines(two_daemons.daemons[0], call_stream)
    try:
        ticket = await e.prefill.offer(e.src, [5, 9, 2])
        result = await e.decode.pull(ticket, e.dst, [0, 1, 63])
        assert (result.path, result.bytes) == ("local", 3 * LAYOUT.bytes_per_block)
        assert _blocks(e.dst_buffers, [0, 1, 63]) == _blocks(e.src_buffers, [5, 9, 2])

        with pytest.raises(InvalidRequestError, match=r"block id 64 outside the pool.s 0\.\.63"):
            await e.prefill.offer(e.src, [64])
        ticket = await e.prefill.offer(e.src, [7])
        forged = dataclasses.replace(ticket, token=bytes(16))
        with pytest.raises(PermissionDeniedError):
            await e.decode.pull(forged, e.dst, [3])
        await e.decode.pull(ticket, e.dst, [3])  # the forged pull left the offer intact
        # The calls went where the mode says: on one open stream, or none was ever opened.
        streams = [c._calls for c in (e.prefill, e.decode)]
        assert all(s is not None and s._stream is not None for s in streams) if call_stream else streams == [None, None]
    finally:
        await e.prefill.close()
        await e.decode.close()


async def test_answers_come_back_in_completion_order_not_request_order(cluster: Cluster) -> None:
    # The pull is held at a fault point before its first byte, so the offer sent after it on
    # the same stream must be answered first, however fast the copy would have been.
    daemon = cluster.daemon("a", "--fault-injection", "--faults", "before_local_copy=pause:3")
    engines = await _engines(daemon, call_stream=True)
    try:
        big = list(range(0, 64, 2))
        pull_ticket = await engines.prefill.offer(engines.src, big)
        async with grpc.aio.insecure_channel("unix:" + engines.daemon.socket) as channel:
            calls = engine_pb2_grpc.EngineServiceStub(channel).Calls()
            pull = engine_pb2.PullRequest(
                ticket=pull_ticket.to_proto(),
                pool_id=engines.dst.pool_id,
                block_ids=list(range(1, 64, 2)),
                timeout_s=30,
                session_id=engines.decode.session_id,
            )
            await calls.write(engine_pb2.CallRequest(call_id=41, pull=pull))
            await calls.write(
                engine_pb2.CallRequest(
                    call_id=42,
                    offer=engine_pb2.OfferRequest(
                        pool_id=engines.src.pool_id, block_ids=[1], session_id=engines.prefill.session_id
                    ),
                )
            )
            first, second = await calls.read(), await calls.read()
            await calls.done_writing()
            assert await calls.read() is grpc.aio.EOF  # both answered: the daemon ends the stream
        assert (first.call_id, first.WhichOneof("result")) == (42, "offer")
        assert (second.call_id, second.WhichOneof("result")) == (41, "pull")
        assert second.pull.bytes == len(big) * LAYOUT.bytes_per_block
        assert _blocks(engines.dst_buffers, list(range(1, 64, 2))) == _blocks(engines.src_buffers, big)
    finally:
        await engines.prefill.close()
        await engines.decode.close()


async def test_many_calls_in_flight_go_batched_both_ways_and_each_lands_its_own_blocks(engines: Engines) -> None:
    # 32 offers, then their 32 pulls, all at once: the SDK writes those queued together in one
    # message once the daemon said it reads them, and the daemon answers so.
    await engines.prefill.offer(engines.src, [0])  # opens the stream; the daemon's metadata is in
    streams = [engines.prefill._calls, engines.decode._calls]
    tickets = await asyncio.gather(*(engines.prefill.offer(engines.src, [i]) for i in range(32)))
    dst_ids = [63 - i for i in range(32)]
    pulled = await asyncio.gather(
        *(engines.decode.pull(t, engines.dst, [d]) for t, d in zip(tickets, dst_ids, strict=True))
    )
    assert all(s is not None and s._stream is not None and s._stream.batched for s in streams)
    assert [p.bytes for p in pulled] == [LAYOUT.bytes_per_block] * 32
    assert _blocks(engines.dst_buffers, dst_ids) == _blocks(engines.src_buffers, list(range(32)))


async def test_callers_cancelled_midway_do_not_disturb_the_other_calls_on_the_stream(engines: Engines) -> None:
    async def offer(i: int) -> str:
        return (await engines.prefill.offer(engines.src, [i % 64])).offer_id

    for _ in range(5):
        tasks = [asyncio.create_task(offer(i)) for i in range(64)]
        for _ in range(3):
            await asyncio.sleep(0)  # some requests are being written now, some are answered
            for task in tasks[::4]:
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        kept = [r for i, r in enumerate(results) if i % 4]
        assert all(isinstance(r, str) for r in kept), [r for r in kept if not isinstance(r, str)][:3]
        for offer_id in kept:
            await engines.prefill.release(str(offer_id))


async def test_a_client_deadline_abandons_the_call_and_the_stream_stays_usable(engines: Engines) -> None:
    client = AsyncKvxferClient(engines.daemon.socket, engine_name="impatient", timeout_s=0.5)
    await client.connect()
    # Its own pool over the same memory (a session offers only its own pools).
    src = await client.register_pool(engines.src_buffers, LAYOUT)
    assert engines.daemon.proc is not None
    os.kill(engines.daemon.proc.pid, signal.SIGSTOP)  # nothing answers now
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=r"did not answer the offer within 0\.5s"):
            await client.offer(src, [3])
        assert time.monotonic() - t0 < 2.0
    finally:
        os.kill(engines.daemon.proc.pid, signal.SIGCONT)
    ticket = await client.offer(src, [4])  # same stream; the late answer went nowhere
    await engines.decode.pull(ticket, engines.dst, [4])
    assert _blocks(engines.dst_buffers, [4]) == _blocks(engines.src_buffers, [4])
    await client.close()


async def test_a_pull_the_caller_stops_waiting_for_is_cancelled_in_the_daemon(cluster: Cluster) -> None:
    a, b = cluster.daemon("a"), cluster.daemon("b", "--peer-timeout-s", "30")
    p = await AsyncKvxferClient(a.socket, engine_name="p").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="d").connect()
    src = await p.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
    dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
    ticket = await p.offer(src, [1, 2])
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)  # the pull now waits on a peer that does not answer
    try:
        pulling = asyncio.create_task(d.pull(ticket, dst, [1, 2], transfer_id="abandoned-1", timeout_s=60))
        for _ in range(200):
            if _transfer_state(b, "abandoned-1") == "TRANSFER_STATE_RUNNING":
                break
            await asyncio.sleep(0.02)
        assert _transfer_state(b, "abandoned-1") == "TRANSFER_STATE_RUNNING"
        pulling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pulling
        for _ in range(200):
            if _transfer_state(b, "abandoned-1") != "TRANSFER_STATE_RUNNING":
                break
            await asyncio.sleep(0.02)
        assert _transfer_state(b, "abandoned-1") == "TRANSFER_STATE_CANCELLED"
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    await p.close()
    await d.close()


async def test_a_daemon_without_the_call_stream_gets_unary_calls(tmp_path: pathlib.Path) -> None:
    """An older kvxferd has no ``Calls`` method (gRPC answers UNIMPLEMENTED): the client sends
    the same call unary, and every later one too. This server has only what that client needs."""
    offers: list[engine_pb2.OfferRequest] = []

    async def watch_events(request: Any, context: Any) -> AsyncIterator[engine_pb2.EngineEvent]:
        yield engine_pb2.EngineEvent(session_started=engine_pb2.SessionStarted(session_id="s", daemon_id="old"))
        await asyncio.Event().wait()

    async def offer(request: engine_pb2.OfferRequest, context: Any) -> engine_pb2.OfferResponse:
        offers.append(request)
        ticket = common_pb2.Ticket(version=1, daemon_id="old", offer_id=f"off-{len(offers)}", token=b"t" * 16)
        ticket.num_blocks, ticket.fingerprint = len(request.block_ids), "f" * 32
        return engine_pb2.OfferResponse(ticket=ticket)

    def handler(fn: Any, response_stream: bool, request_cls: Any, response_cls: Any) -> grpc.RpcMethodHandler:
        make = grpc.unary_stream_rpc_method_handler if response_stream else grpc.unary_unary_rpc_method_handler
        return make(fn, request_cls.FromString, response_cls.SerializeToString)

    methods = {
        "WatchEvents": handler(watch_events, True, engine_pb2.WatchEventsRequest, engine_pb2.EngineEvent),
        "Offer": handler(offer, False, engine_pb2.OfferRequest, engine_pb2.OfferResponse),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvxfer.v1.EngineService", methods),))
    path = str(tmp_path / "old.sock")
    server.add_insecure_port("unix:" + path)
    await server.start()
    try:
        async with AsyncKvxferClient(path, engine_name="e", call_stream=True) as client:
            first = await client.offer("pool-x", [1, 2])
            second = await client.offer("pool-x", [3])
            assert client._calls is not None and client._calls.unsupported
    finally:
        await server.stop(None)
    assert (first.offer_id, second.offer_id) == ("off-1", "off-2")
    assert [list(r.block_ids) for r in offers] == [[1, 2], [3]]  # each offer ran exactly once


async def test_a_lost_daemon_fails_waiting_calls_with_unavailable(cluster: Cluster) -> None:
    a, b = cluster.daemon("a"), cluster.daemon("b", "--peer-timeout-s", "30")
    p = await AsyncKvxferClient(a.socket, engine_name="p").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="d").connect()
    src = await p.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
    dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
    ticket = await p.offer(src, [1])
    assert a.proc is not None and b.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)
    pulling = asyncio.create_task(d.pull(ticket, dst, [1], timeout_s=60))
    await asyncio.sleep(0.3)
    b.proc.kill()  # the decode daemon dies with the pull on its stream
    t0 = time.monotonic()
    with pytest.raises(KvxferError) as failure:
        await pulling
    assert time.monotonic() - t0 < 5.0
    assert type(failure.value).__name__ == "UnavailableError", failure.value
    os.kill(a.proc.pid, signal.SIGCONT)
    await p.close()
    await d.close()
