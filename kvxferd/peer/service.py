"""PeerService: what other daemons call, over TCP."""

from __future__ import annotations

from typing import Any

from kvxfer.proto import peer_pb2, peer_pb2_grpc

from .._log import log_event
from ..edge import wire
from ..edge.rpc import rpc_method
from .identity import PeerCertificate
from .serve_request import PeerNode
from .transfers import serve_transfers

Ctx = Any  # grpc.aio.ServicerContext


class PeerService(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, node: PeerNode) -> None:
        self.node = node

    def _certificate(self, context: Ctx) -> PeerCertificate:
        return PeerCertificate(context, bool(self.node.settings.tls_cert))

    @rpc_method
    async def Hello(self, request: peer_pb2.HelloRequest, context: Ctx) -> peer_pb2.HelloResponse:  # noqa: N802
        self._certificate(context).check(request.identity.daemon_id)
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
        pid, address = self.node.write_proof(bytes(request.nonce))
        return peer_pb2.DirectReadProof(pid=pid, address=address)

    @rpc_method
    # Served with context.read()/write() rather than as a generator: requests and answers
    # interleave per transfer (:mod:`.transfers`).
    async def Transfers(self, request_iterator: Any, context: Ctx) -> None:  # type: ignore[override]  # noqa: N802
        await serve_transfers(context, self.node)

    @rpc_method
    async def TierOffer(  # noqa: N802
        self, request: peer_pb2.PeerTierOfferRequest, context: Ctx
    ) -> peer_pb2.PeerTierOfferResponse:
        self.node.peers.known(self._certificate(context).check(request.daemon_id))  # a peer that said Hello
        return await self.node.serve_tier_offer(request)

    @rpc_method
    async def Announce(self, request: peer_pb2.PushAnnouncement, context: Ctx) -> peer_pb2.PushAnnounced:  # noqa: N802
        settings = self.node.settings
        matched = self.node.push_announced(
            wire.transfer_id(request.transfer_id, required=True),
            wire.ticket(request.ticket),
            wire.lease_s(request.lease_s, None, settings.max_lease_s),
            self._certificate(context).check(request.daemon_id),
        )
        log_event("push.announced", transfer_id=request.transfer_id, peer_daemon_id=request.daemon_id, matched=matched)
        return peer_pb2.PushAnnounced(matched=matched)

    @rpc_method
    async def ExtendLease(  # noqa: N802
        self, request: peer_pb2.PeerExtendLeaseRequest, context: Ctx
    ) -> peer_pb2.PeerExtendLeaseResponse:
        lease = wire.lease_s(request.lease_s, None, self.node.settings.max_lease_s)
        remaining = self.node.offers.extend(request.offer_id, bytes(request.token), lease)
        return peer_pb2.PeerExtendLeaseResponse(lease_remaining_s=remaining)
