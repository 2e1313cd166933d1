"""PeerService: what other daemons call, over TCP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kvxfer_client._errors import InvalidRequestError
from kvxfer_client._proto import common_pb2, peer_pb2, peer_pb2_grpc

from .._log import log_event
from .._node import Node
from ..handoff.steps import within
from . import wire
from ._rpc import rpc_method

Ctx = Any  # grpc.aio.ServicerContext


class PeerService(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @rpc_method
    async def Hello(self, request: peer_pb2.HelloRequest, context: Ctx) -> peer_pb2.HelloResponse:  # noqa: N802
        self.node.accept_hello(request.identity)
        log_event(
            "peer.hello",
            peer_daemon_id=request.identity.daemon_id,
            peer_address=request.identity.peer_address or context.peer(),
            transports=",".join(request.identity.ucx_transports),
        )
        return peer_pb2.HelloResponse(identity=self.node.identity())

    @rpc_method
    async def ProbeDirectRead(  # noqa: N802
        self, request: peer_pb2.DirectReadProbe, context: Ctx
    ) -> peer_pb2.DirectReadProof:
        pid, address = self.node.proofs.write(bytes(request.nonce))
        return peer_pb2.DirectReadProof(pid=pid, address=address)

    @rpc_method
    # Served with context.read()/write() rather than as a generator: the exchange is a
    # fixed sequence of steps (see peer.proto), not a stream of like messages.
    async def Transfer(self, request_iterator: Any, context: Ctx) -> None:  # type: ignore[override]  # noqa: N802
        settings = self.node.settings
        first = await within(context.read(), settings.peer_timeout_s, "the puller's 'start'")
        if first is grpc.aio.EOF or first.WhichOneof("msg") != "start":
            raise InvalidRequestError("a Transfer stream must begin with start")
        start = wire.serve_request(first.start, settings.pull_timeout_s)
        await self.node.serve(start, _OffererStream(context))

    @rpc_method
    async def ExtendLease(  # noqa: N802
        self, request: peer_pb2.PeerExtendLeaseRequest, context: Ctx
    ) -> peer_pb2.PeerExtendLeaseResponse:
        lease = wire.lease_s(request.lease_s, None, self.node.settings.max_lease_s)
        remaining = self.node.offers.extend(request.offer_id, bytes(request.token), lease)
        return peer_pb2.PeerExtendLeaseResponse(lease_remaining_s=remaining)


class _OffererStream:
    """The gRPC ``Transfer`` stream as the offering side's handoff sees it (OffererStream)."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._context = context

    def puller_gone(self) -> bool:
        return bool(self._context.done())

    def on_puller_gone(self, callback: Callable[[], None]) -> None:
        self._context.add_done_callback(lambda _: callback())

    def time_remaining(self) -> float | None:
        left = self._context.time_remaining()
        return None if left is None else float(left)

    async def send_headers(self) -> None:
        await self._context.send_initial_metadata(())

    async def accepted(
        self,
        total_bytes: int,
        num_chunks: int,
        chunk_bytes: int,
        signature: common_pb2.LayoutSignature,
        direct: peer_pb2.DirectReadSource | None = None,
    ) -> None:
        msg = peer_pb2.TransferAccepted(
            total_bytes=total_bytes,
            num_chunks=num_chunks,
            chunk_bytes=chunk_bytes,
            sender_signature=signature,
            direct=direct,
        )
        await self._context.write(peer_pb2.TransferServerMessage(accepted=msg))

    async def sent(self, nbytes: int, transport: str) -> None:
        msg = peer_pb2.TransferSent(bytes=nbytes, transport=transport)
        await self._context.write(peer_pb2.TransferServerMessage(sent=msg))

    async def read_done(self) -> tuple[bool, str, int] | None:
        msg = await self._context.read()
        if msg is grpc.aio.EOF or msg.WhichOneof("msg") != "done":
            return None
        return bool(msg.done.ok), str(msg.done.detail), max(1, int(msg.done.readers))

    async def closed(self) -> None:
        await self._context.write(peer_pb2.TransferServerMessage(closed=peer_pb2.TransferClosed(released=True)))
