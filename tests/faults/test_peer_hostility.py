"""A peer's UCX worker address is hostile until checked (issue: a random address aborted the
daemon inside UCX). Fake peers here are real gRPC servers in the test process; the daemons
under test are real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from bench.cluster import ROOT, Cluster, Daemon, _env
from kvxfer.proto import common_pb2, peer_pb2, peer_pb2_grpc
from kvxfer.version import PROTOCOL_VERSION
from kvxfer_client import (
    AsyncKvxferClient,
    HostBuffer,
    IncompatibleError,
    Layout,
    ReleaseReason,
    Ticket,
    UnavailableError,
)
from kvxferd.dataplane.ucx_address import AddressProbe

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=32, block_bytes=16 << 10)


def _random_address(version_byte: int) -> bytes:
    return bytes([version_byte]) + os.urandom(216)


class FakePeer(peer_pb2_grpc.PeerServiceServicer):
    """Answers Hello with a chosen worker address; nothing else."""

    def __init__(self, address: bytes) -> None:
        self.address = address

    async def Hello(self, request: peer_pb2.HelloRequest, context: object) -> peer_pb2.HelloResponse:  # noqa: N802
        return peer_pb2.HelloResponse(
            identity=peer_pb2.PeerIdentity(
                daemon_id="forged-peer",
                version="0",
                protocol_version=PROTOCOL_VERSION,
                hostname="elsewhere",
                ucx_worker_address=self.address,
                ucx_transports=["tcp"],
            )
        )


@pytest.fixture
async def daemon_pair(cluster: Cluster) -> AsyncIterator[tuple[Daemon, Daemon]]:
    yield cluster.daemon("a"), cluster.daemon("b")


async def _serve_fake(address: bytes) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    peer_pb2_grpc.add_PeerServiceServicer_to_server(FakePeer(address), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _local_handoff_works(daemon: Daemon) -> None:
    async with (
        AsyncKvxferClient(daemon.socket, engine_name="p") as p,
        AsyncKvxferClient(daemon.socket, engine_name="d") as d,
    ):
        src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        for buf in src:
            buf.array()[:] = np.random.default_rng(1).integers(0, 256, buf.size, dtype=np.uint8)
        dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        src_pool, dst_pool = await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT)
        ticket = await p.offer(src_pool, [1, 2])
        await d.pull(ticket, dst_pool, [3, 4])
        assert (await p.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.PULLED


@pytest.mark.parametrize("version_byte", [0x2B, 0x25, 0x00])
async def test_a_forged_ticket_to_a_peer_with_a_random_worker_address_fails_the_pull_not_the_daemon(
    daemon_pair: tuple[Daemon, Daemon], version_byte: int
) -> None:
    _, b = daemon_pair
    server, address = await _serve_fake(_random_address(version_byte) if version_byte else bytes(217))
    try:
        async with AsyncKvxferClient(b.socket, engine_name="decode") as d:
            dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
            forged = Ticket(
                daemon_id="forged-peer",
                peer_address=address,
                offer_id="off-0",
                token=b"\1" * 16,
                num_blocks=1,
                fingerprint=dst.fingerprint,
                total_bytes=LAYOUT.bytes_per_block,
            )
            with pytest.raises(IncompatibleError, match="malformed UCX worker address"):
                await d.pull(forged, dst, [0], timeout_s=10)
        assert b.proc is not None and b.proc.poll() is None, b.log()
        await _local_handoff_works(b)
    finally:
        await server.stop(None)


async def test_a_hello_with_a_random_worker_address_then_a_transfer_is_refused_and_the_offer_survives(
    daemon_pair: tuple[Daemon, Daemon],
) -> None:
    a, b = daemon_pair
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src = await p.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        dst = await d.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        ticket = await p.offer(src, [5, 6], lease_s=60)
        async with grpc.aio.insecure_channel(a.info["peer_address"]) as channel:
            stub = peer_pb2_grpc.PeerServiceStub(channel)
            identity = peer_pb2.PeerIdentity(
                daemon_id="attacker",
                version="0",
                protocol_version=PROTOCOL_VERSION,
                hostname="elsewhere",
                ucx_worker_address=_random_address(0x2B),
                ucx_transports=["tcp"],
            )
            with pytest.raises(grpc.aio.AioRpcError) as hello:
                await stub.Hello(peer_pb2.HelloRequest(identity=identity), timeout=10)
            assert hello.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "malformed UCX worker address" in (hello.value.details() or "")
            call = stub.Transfers(timeout=10)
            await call.write(
                peer_pb2.TransferClientMessage(
                    transfer_id="evil-1",
                    start=peer_pb2.TransferStart(
                        transfer_id="evil-1",
                        offer_id=ticket.offer_id,
                        token=ticket.token,
                        receiver_daemon_id="attacker",
                        receiver_signature=common_pb2.LayoutSignature(),
                        num_blocks=2,
                        tag_base=1 << 24,
                        chunk_bytes=1 << 20,
                        timeout_s=5,
                    ),
                )
            )
            answer = await call.read()
            assert answer.transfer_id == "evil-1" and answer.WhichOneof("msg") == "failed"
            assert answer.failed.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], answer
            call.cancel()
        assert a.proc is not None and a.proc.poll() is None, a.log()
        # The offer was never claimed: the real decode engine still pulls it.
        await d.pull(ticket, dst, [1, 2], timeout_s=20)
        assert (await p.wait_released(ticket.offer_id, 5)).reason is ReleaseReason.PULLED


async def test_the_address_probe_contains_a_ucx_abort_and_keeps_serving() -> None:
    import ucxx

    own = bytes(ucxx.get_worker_address())
    probe = AddressProbe()
    try:
        await probe.check(own, False, "self")  # a real address passes
        # Past the structural check's back: version 11 makes UCX assert and abort.
        with pytest.raises(IncompatibleError, match="crashed UCX in the probe process"):
            await probe.check(_random_address(0x2B), False, "hostile")
        assert probe.crashes == 1
        await probe.check(own, True, "self")  # a fresh child answers the next one
    finally:
        await probe.close()


async def test_an_endpoint_that_keeps_failing_is_replaced_and_later_pulls_succeed(cluster: Cluster) -> None:
    # A field run saw ~1,000 pulls in a row fail over the endpoint a frozen peer left behind.
    # The fault point breaks the offerer's endpoint for good: every send over it fails, so
    # only a new endpoint (and the puller's new Hello) lets later pulls through.
    a = cluster.daemon("a", "--fault-injection", "--faults", "endpoint_broken=fail:1")
    b = cluster.daemon("b")
    async with (
        AsyncKvxferClient(a.socket, engine_name="p") as prefill,
        AsyncKvxferClient(b.socket, engine_name="d") as decode,
    ):
        src = await prefill.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        dst = await decode.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        first = await prefill.offer(src, [0, 1])
        with pytest.raises(UnavailableError, match="broken by fault injection"):
            await decode.pull(first, dst, [0, 1], timeout_s=20)
        for i in range(3):
            ticket = await prefill.offer(src, [2 + i])
            await decode.pull(ticket, dst, [2 + i], timeout_s=20)
        assert "ucx.endpoint_retired" in a.log()
        assert a.log().count("peer.hello") >= 2, "the puller did not say Hello again"


async def test_daemons_that_differ_in_ucx_error_handling_fail_at_once_naming_the_setting(cluster: Cluster) -> None:
    # UCX refuses such an endpoint only when data arrives; the pull used to wait for its deadline.
    a = cluster.daemon("a", "--ucx-error-handling", "on")
    b = cluster.daemon("b")
    async with (
        AsyncKvxferClient(a.socket, engine_name="p") as prefill,
        AsyncKvxferClient(b.socket, engine_name="d") as decode,
    ):
        src = await prefill.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        dst = await decode.register_pool([HostBuffer.create(s) for s in LAYOUT.buffer_sizes()], LAYOUT)
        ticket = await prefill.offer(src, [0])
        started = time.monotonic()
        with pytest.raises(IncompatibleError, match="give both daemons the same ucx_error_handling"):
            await decode.pull(ticket, dst, [0], timeout_s=30)
        assert time.monotonic() - started < 10


async def test_malformed_messages_on_a_transfer_stream_get_typed_refusals_and_the_stream_keeps_serving(
    daemon_pair: tuple[Daemon, Daemon],
) -> None:
    a, _ = daemon_pair

    def start(transfer_id: str, **changes: object) -> peer_pb2.TransferClientMessage:
        fields: dict[str, object] = {
            "transfer_id": transfer_id,
            "offer_id": "no-such-offer",
            "receiver_daemon_id": "stranger",
            "receiver_signature": common_pb2.LayoutSignature(),
            "num_blocks": 1,
            "tag_base": 1 << 24,
            "chunk_bytes": 1 << 20,
            "timeout_s": 5,
        }
        fields.update(changes)
        return peer_pb2.TransferClientMessage(transfer_id=transfer_id, start=peer_pb2.TransferStart(**fields))

    async with grpc.aio.insecure_channel(a.info["peer_address"]) as channel:
        call = peer_pb2_grpc.PeerServiceStub(channel).Transfers(timeout=30)
        cases = [
            # (message, its transfer id, the code it must be refused with)
            (start(""), "", grpc.StatusCode.INVALID_ARGUMENT),
            (start("x" * 129), "x" * 128, grpc.StatusCode.INVALID_ARGUMENT),
            (start("nan", deadline_s=float("nan")), "nan", grpc.StatusCode.INVALID_ARGUMENT),
            (start("neg", timeout_s=-1), "neg", grpc.StatusCode.INVALID_ARGUMENT),
            (start("huge", chunk_bytes=1 << 40), "huge", grpc.StatusCode.INVALID_ARGUMENT),
            # A start whose body names another transfer than its message.
            (
                peer_pb2.TransferClientMessage(transfer_id="outer", start=start("inner").start),
                "outer",
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            # Well formed, from a daemon that never said Hello.
            (start("stranger"), "stranger", grpc.StatusCode.FAILED_PRECONDITION),
        ]
        for msg, transfer_id, code in cases:
            # Messages for transfers that are not running are ignored, not answered.
            await call.write(peer_pb2.TransferClientMessage(transfer_id="ghost", done=peer_pb2.TransferDone(ok=True)))
            await call.write(peer_pb2.TransferClientMessage(transfer_id="ghost", abort=peer_pb2.TransferAbort()))
            await call.write(peer_pb2.TransferClientMessage(transfer_id="ghost"))
            await call.write(msg)
            answer = await call.read()
            assert (answer.transfer_id, answer.WhichOneof("msg")) == (transfer_id, "failed"), answer
            assert answer.failed.code == code.value[0], answer
        call.cancel()
    assert a.proc is not None and a.proc.poll() is None, a.log()
    await _local_handoff_works(a)


#: In its own process: UCX loaded, uvloop running, and a fork handler that never returns in the
#: child (as UCX's memory hook spun on a lock another thread held at the fork). A probe started
#: by fork() would never reach exec, and the event loop would wait for it forever.
_WEDGED_FORK = """
import asyncio, ctypes, sys, time
import uvloop, ucxx
from kvxferd.dataplane.ucx_address import AddressProbe
own = bytes(ucxx.get_worker_address())
libc = ctypes.CDLL(None)
libc.__register_atfork.argtypes = [ctypes.c_void_p] * 4
assert libc.__register_atfork(None, None, ctypes.cast(libc.pause, ctypes.c_void_p), None) == 0

async def main():
    probe = AddressProbe()
    started = time.monotonic()
    probe.start()  # at daemon start and again after every probe crash or timeout
    await asyncio.wait_for(probe.check(own, False, "self"), 20)
    await probe.close()
    print(f"probe ready in {time.monotonic() - started:.2f}s", flush=True)

uvloop.run(main())
"""


def test_the_probe_child_starts_even_when_a_fork_would_wedge_in_its_fork_handlers() -> None:
    """Regression: the probe was spawned with fork (uvloop's uv_spawn), whose child runs the
    parent's fork handlers before exec; one that spins (UCX's memory hook on a lock held at
    the fork) wedged the daemon's loop for good. posix_spawn runs none: the probe starts, and
    answers, with such a handler installed."""
    done = subprocess.run(
        [sys.executable, "-c", _WEDGED_FORK], capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT
    )
    assert done.returncode == 0 and "probe ready" in done.stdout, done.stderr[-2000:]
