"""PeerService: what other daemons call, over TCP."""

from __future__ import annotations

from typing import Any

from kvxfer_client._errors import InvalidRequestError, UnavailableError
from kvxfer_client._proto import peer_pb2, peer_pb2_grpc

from .._log import log_event
from .._node import Node
from ._rpc import rpc_method

Ctx = Any  # grpc.aio.ServicerContext


class PeerService(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @rpc_method
    async def Hello(self, request: peer_pb2.HelloRequest, context: Ctx) -> peer_pb2.HelloResponse:  # noqa: N802
        if self.node.peers is None:
            raise UnavailableError("daemon is starting")
        known = self.node.peers.by_id.get(request.identity.daemon_id)
        old_address = known.identity.ucx_worker_address if known is not None else None
        self.node.peers.accept_hello(request.identity)
        if self.node.ucx is not None:
            self.node.ucx.address_probe.start()  # again, if its child died since
            if old_address is not None and old_address != request.identity.ucx_worker_address:
                self.node.ucx.retire(request.identity.daemon_id, "the peer came back with a new worker")
        log_event(
            "peer.hello",
            peer_daemon_id=request.identity.daemon_id,
            peer_address=request.identity.peer_address or context.peer(),
            transports=",".join(request.identity.ucx_transports),
        )
        return peer_pb2.HelloResponse(identity=self.node.identity())

    @rpc_method
    # Served with context.read()/write() rather than as a generator: the exchange is a
    # fixed sequence of steps (see peer.proto), not a stream of like messages.
    async def Transfer(self, request_iterator: Any, context: Ctx) -> None:  # type: ignore[override]  # noqa: N802
        await self.node.serve_transfer(context)

    @rpc_method
    async def ExtendLease(  # noqa: N802
        self, request: peer_pb2.PeerExtendLeaseRequest, context: Ctx
    ) -> peer_pb2.PeerExtendLeaseResponse:
        max_lease = self.node.settings.max_lease_s
        if not 0 < request.lease_s <= max_lease:
            raise InvalidRequestError(f"lease_s must be in (0, {max_lease}]")
        remaining = self.node.offers.extend(request.offer_id, bytes(request.token), request.lease_s)
        return peer_pb2.PeerExtendLeaseResponse(lease_remaining_s=remaining)
