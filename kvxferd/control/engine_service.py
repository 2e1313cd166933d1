"""EngineService: the local engines' API, on the daemon's Unix socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvxfer_client._proto import engine_pb2, engine_pb2_grpc

from .._node import Node
from ._rpc import rpc_method
from .call_stream import serve_calls

Ctx = Any  # grpc.aio.ServicerContext


class EngineService(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @rpc_method
    async def WatchEvents(  # noqa: N802 - gRPC method name
        self, request: engine_pb2.WatchEventsRequest, context: Ctx
    ) -> AsyncIterator[engine_pb2.EngineEvent]:
        session = self.node.open_session(request.engine_name)
        try:
            yield engine_pb2.EngineEvent(
                session_started=engine_pb2.SessionStarted(session_id=session.session_id, daemon_id=self.node.daemon_id)
            )
            while True:
                yield await session.events.get()
        finally:
            # The stream ends when the engine disconnects or exits: its memory may be gone.
            self.node.close_session(session)

    @rpc_method
    async def RegisterPool(  # noqa: N802
        self, request: engine_pb2.RegisterPoolRequest, context: Ctx
    ) -> engine_pb2.RegisterPoolResponse:
        pool = self.node.register_pool(request)
        return engine_pb2.RegisterPoolResponse(pool_id=pool.pool_id, fingerprint=pool.fingerprint)

    @rpc_method
    async def DeregisterPool(  # noqa: N802
        self, request: engine_pb2.DeregisterPoolRequest, context: Ctx
    ) -> engine_pb2.DeregisterPoolResponse:
        self.node.owned_pool(request.pool_id, request.session_id)
        return engine_pb2.DeregisterPoolResponse(released_offers=self.node.deregister_pool(request.pool_id))

    async def _offer(self, request: engine_pb2.OfferRequest) -> engine_pb2.OfferResponse:
        offer, ticket = self.node.offer(request)
        return engine_pb2.OfferResponse(ticket=ticket.to_proto(), lease_deadline_unix=offer.deadline)

    @rpc_method
    async def Offer(self, request: engine_pb2.OfferRequest, context: Ctx) -> engine_pb2.OfferResponse:  # noqa: N802
        return await self._offer(request)

    @rpc_method
    async def Pull(self, request: engine_pb2.PullRequest, context: Ctx) -> engine_pb2.PullResponse:  # noqa: N802
        return await self.node.pull(request)

    @rpc_method
    # Served with context.read()/write(): answers go out in completion order, not request order.
    async def Calls(self, request_iterator: Any, context: Ctx) -> None:  # type: ignore[override]  # noqa: N802
        await serve_calls(context, {"offer": self._offer, "pull": self.node.pull})

    @rpc_method
    async def Release(self, request: engine_pb2.ReleaseRequest, context: Ctx) -> engine_pb2.ReleaseResponse:  # noqa: N802
        self.node.withdraw(request.offer_id, request.session_id)
        return engine_pb2.ReleaseResponse()

    @rpc_method
    async def Cancel(self, request: engine_pb2.CancelRequest, context: Ctx) -> engine_pb2.CancelResponse:  # noqa: N802
        cancelled, may_still_write = await self.node.cancel_transfer(request.transfer_id, request.session_id)
        return engine_pb2.CancelResponse(cancelled=cancelled, may_still_write=may_still_write)

    @rpc_method
    async def ExtendLease(  # noqa: N802
        self, request: engine_pb2.ExtendLeaseRequest, context: Ctx
    ) -> engine_pb2.ExtendLeaseResponse:
        remaining = await self.node.extend_lease(request.ticket, request.lease_s)
        return engine_pb2.ExtendLeaseResponse(lease_remaining_s=remaining)
