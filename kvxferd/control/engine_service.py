"""EngineService: the local engines' API, on the daemon's Unix socket."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from kvxfer.errors import InvalidRequestError, KvxferError
from kvxfer.layout import MAX_BLOCKS
from kvxfer.proto import engine_pb2, engine_pb2_grpc

from .._asks import OfferAsk, PullAsk, ReceiveAsk
from .._node import Node
from .._transfers import TransferRecord
from ..edge import wire
from ..edge.rpc import rpc_method
from ..memory.pools import PoolIdentity
from ..tier.acts import TierAsk
from .call_stream import Handlers, serve_calls

Ctx = Any  # grpc.aio.ServicerContext
#: Offers one LayersReady may name (one step of an engine's batch).
MAX_OFFER_IDS = 4096
T = TypeVar("T")


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
                session_started=engine_pb2.SessionStarted(
                    session_id=session.session_id, daemon_id=self.node.daemon_id, peer_address=self.node.peer_address
                )
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
        keep = PoolIdentity(request.pool_id, bytes(request.offer_key))
        pool = self.node.register_pool(request.session_id, request.buffers, request.layout, request.name, keep)
        return engine_pb2.RegisterPoolResponse(
            pool_id=pool.pool_id, fingerprint=pool.fingerprint, offer_key=pool.offer_key
        )

    @rpc_method
    async def DeregisterPool(  # noqa: N802
        self, request: engine_pb2.DeregisterPoolRequest, context: Ctx
    ) -> engine_pb2.DeregisterPoolResponse:
        self.node.admission.owned_pool(request.pool_id, request.session_id)
        return engine_pb2.DeregisterPoolResponse(released_offers=self.node.deregister_pool(request.pool_id))

    async def _timed(self, method: str, call: Awaitable[T]) -> T:
        """``await call``, observed in the engine-call latency histogram with its status code."""
        started, code = time.perf_counter(), "OK"
        try:
            return await call
        except KvxferError as exc:
            code = exc.grpc_code.name
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            # Observed once the answer is on its way (its write starts in this turn of the loop).
            asyncio.get_running_loop().call_soon(
                self.node.metrics.rpc_finished, method, code, time.perf_counter() - started
            )

    async def _offer(self, request: engine_pb2.OfferRequest) -> engine_pb2.OfferResponse:
        return await self._timed("offer", self._offer_now(request))

    async def _pull(self, request: engine_pb2.PullRequest) -> engine_pb2.PullResponse:
        return await self._timed("pull", self._pull_now(request))

    async def _offer_now(self, request: engine_pb2.OfferRequest) -> engine_pb2.OfferResponse:
        s = self.node.settings
        lease = wire.lease_s(request.lease_s, s.default_lease_s, s.max_lease_s)
        chosen = wire.chosen_offer(request.offer_id, request.token)
        ask = OfferAsk(
            request.session_id,
            request.pool_id,
            request.block_ids,
            lease,
            chosen,
            bytes(request.offer_key),
            wire.readers(request.readers),
            wire.layers(request.layers),
        )
        offer, ticket = self.node.offer(ask)
        return engine_pb2.OfferResponse(ticket=ticket.to_proto(), lease_deadline_unix=offer.deadline)

    async def _pull_now(self, request: engine_pb2.PullRequest) -> engine_pb2.PullResponse:
        ticket = wire.ticket(request.ticket)
        timeout = wire.pull_timeout_s(request.timeout_s, self.node.settings.pull_timeout_s)
        transfer_id = wire.transfer_id(request.transfer_id)
        indices = wire.offer_block_indices(request.offer_block_indices)
        ask = PullAsk(request.session_id, request.pool_id, ticket, request.block_ids, timeout, transfer_id, indices)
        record = await self.node.pull(ask)
        return _pull_response(record)

    async def _push(self, request: engine_pb2.PushRequest) -> engine_pb2.PushResponse:
        return await self._timed("push", self._push_now(request))

    async def _receive(self, request: engine_pb2.ReceiveRequest) -> engine_pb2.PullResponse:
        return await self._timed("receive", self._receive_now(request))

    async def _push_now(self, request: engine_pb2.PushRequest) -> engine_pb2.PushResponse:
        s, offer = self.node.settings, request.offer
        if offer.offer_id or offer.token or offer.readers > 1:
            raise InvalidRequestError("a push makes its own offer for one reader: no offer_id, token or readers")
        ask = OfferAsk(
            offer.session_id,
            offer.pool_id,
            offer.block_ids,
            wire.lease_s(offer.lease_s, s.default_lease_s, s.max_lease_s),
            offer_key=bytes(offer.offer_key),
            layers=wire.layers(offer.layers),
        )
        transfer_id = wire.transfer_id(request.transfer_id, required=True)
        pushed = await self.node.pushes.push(ask, transfer_id, wire.peer_address(request.to_peer_address))
        return engine_pb2.PushResponse(
            ticket=pushed.ticket.to_proto(),
            lease_deadline_unix=pushed.offer.deadline,
            mode=pushed.mode,
            mode_reason=pushed.mode_reason,
        )

    async def _receive_now(self, request: engine_pb2.ReceiveRequest) -> engine_pb2.PullResponse:
        if len(request.from_daemon_id) > 256:
            raise InvalidRequestError("from_daemon_id too long")
        ask = ReceiveAsk(
            request.session_id,
            request.pool_id,
            request.block_ids,
            wire.transfer_id(request.transfer_id, required=True),
            wire.pull_timeout_s(request.timeout_s, self.node.settings.pull_timeout_s),
            request.from_daemon_id,
            wire.offer_block_indices(request.offer_block_indices),
        )
        record = await self.node.pushes.receive(ask)
        return _pull_response(record)

    async def _layers_ready(self, request: engine_pb2.LayersReadyRequest) -> engine_pb2.LayersReadyResponse:
        if len(request.offer_ids) > MAX_OFFER_IDS:
            raise InvalidRequestError("too many offer_ids")
        self.node.layers_ready(request.session_id, request.offer_ids, request.layers, bytes(request.offer_key))
        return engine_pb2.LayersReadyResponse()

    @rpc_method
    async def LayersReady(  # noqa: N802
        self, request: engine_pb2.LayersReadyRequest, context: Ctx
    ) -> engine_pb2.LayersReadyResponse:
        return await self._layers_ready(request)

    @rpc_method
    async def TierStore(  # noqa: N802
        self, request: engine_pb2.TierStoreRequest, context: Ctx
    ) -> engine_pb2.TierStoreResponse:
        return await self._timed("tier_store", self._tier_store(request))

    @rpc_method
    async def TierLookup(  # noqa: N802
        self, request: engine_pb2.TierLookupRequest, context: Ctx
    ) -> engine_pb2.TierLookupResponse:
        if len(request.keys) > MAX_BLOCKS:
            raise InvalidRequestError(f"more than {MAX_BLOCKS} keys")
        keys, salt = list(request.keys), bytes(request.salt)
        if request.from_peer:
            ask = TierAsk(request.session_id, request.pool_id, keys, salt)
            hits = await self.node.kv_tier.from_peer(ask, request.from_peer)
            return engine_pb2.TierLookupResponse(hits=hits)
        ask = TierAsk(request.session_id, request.pool_id, keys, salt, bytes(request.offer_key))
        return engine_pb2.TierLookupResponse(hits=self.node.kv_tier.lookup(ask))

    @rpc_method
    async def TierLoad(  # noqa: N802
        self, request: engine_pb2.TierLoadRequest, context: Ctx
    ) -> engine_pb2.TierLoadResponse:
        return await self._timed("tier_load", self._tier_load(request))

    @rpc_method
    async def TierOffer(self, request: engine_pb2.TierOfferRequest, context: Ctx) -> engine_pb2.OfferResponse:  # noqa: N802
        return await self._timed("tier_offer", self._tier_offer(request))

    async def _tier_offer(self, request: engine_pb2.TierOfferRequest) -> engine_pb2.OfferResponse:
        s = self.node.settings
        if len(request.keys) > MAX_BLOCKS:
            raise InvalidRequestError(f"more than {MAX_BLOCKS} keys")
        lease = wire.lease_s(request.lease_s, s.default_lease_s, s.max_lease_s)
        ask = TierAsk(
            request.session_id, request.pool_id, list(request.keys), bytes(request.salt), bytes(request.offer_key)
        )
        offer, ticket = await self.node.kv_tier.offer(ask, lease, wire.readers(request.readers), request.prefix)
        if offer is None or ticket is None:  # a prefix of nothing: no offer
            return engine_pb2.OfferResponse()
        return engine_pb2.OfferResponse(ticket=ticket.to_proto(), lease_deadline_unix=offer.deadline)

    async def _tier_store(self, request: engine_pb2.TierStoreRequest) -> engine_pb2.TierStoreResponse:
        ask = TierAsk(request.session_id, request.pool_id, list(request.keys), bytes(request.salt))
        stored, skipped = await self.node.kv_tier.store(ask, request.block_ids)
        return engine_pb2.TierStoreResponse(stored=stored, skipped=skipped)

    async def _tier_load(self, request: engine_pb2.TierLoadRequest) -> engine_pb2.TierLoadResponse:
        ask = TierAsk(request.session_id, request.pool_id, list(request.keys), bytes(request.salt))
        if request.from_peer:
            timeout = wire.pull_timeout_s(request.timeout_s, self.node.settings.pull_timeout_s)
            loaded = await self.node.kv_tier.from_peer(ask, request.from_peer, request.block_ids, timeout)
        else:
            loaded = await self.node.kv_tier.load(ask, request.block_ids)
        return engine_pb2.TierLoadResponse(loaded=loaded)

    @rpc_method
    async def Push(self, request: engine_pb2.PushRequest, context: Ctx) -> engine_pb2.PushResponse:  # noqa: N802
        return await self._push(request)

    @rpc_method
    async def Receive(self, request: engine_pb2.ReceiveRequest, context: Ctx) -> engine_pb2.PullResponse:  # noqa: N802
        return await self._receive(request)

    @rpc_method
    async def Offer(self, request: engine_pb2.OfferRequest, context: Ctx) -> engine_pb2.OfferResponse:  # noqa: N802
        return await self._offer(request)

    @rpc_method
    async def Pull(self, request: engine_pb2.PullRequest, context: Ctx) -> engine_pb2.PullResponse:  # noqa: N802
        return await self._pull(request)

    @rpc_method
    # Served with context.read()/write(): answers go out in completion order, not request order.
    async def Calls(self, request_iterator: Any, context: Ctx) -> None:  # type: ignore[override]  # noqa: N802
        handlers: Handlers = {
            "offer": self._offer,
            "pull": self._pull,
            "push": self._push,
            "receive": self._receive,
            "layers_ready": self._layers_ready,
        }
        await serve_calls(context, handlers)

    @rpc_method
    async def Release(self, request: engine_pb2.ReleaseRequest, context: Ctx) -> engine_pb2.ReleaseResponse:  # noqa: N802
        self.node.release(request.offer_id, request.session_id)
        return engine_pb2.ReleaseResponse()

    @rpc_method
    async def Cancel(self, request: engine_pb2.CancelRequest, context: Ctx) -> engine_pb2.CancelResponse:  # noqa: N802
        outcome = await self.node.cancel(wire.transfer_id(request.transfer_id, required=True), request.session_id)
        return engine_pb2.CancelResponse(cancelled=outcome.cancelled, may_still_write=outcome.may_still_write)

    @rpc_method
    async def ExtendLease(  # noqa: N802
        self, request: engine_pb2.ExtendLeaseRequest, context: Ctx
    ) -> engine_pb2.ExtendLeaseResponse:
        ticket = wire.ticket(request.ticket)
        lease = wire.lease_s(request.lease_s, None, self.node.settings.max_lease_s)
        remaining = await self.node.extend_lease(ticket, lease)
        return engine_pb2.ExtendLeaseResponse(lease_remaining_s=remaining)


def _pull_response(record: TransferRecord) -> engine_pb2.PullResponse:
    return engine_pb2.PullResponse(
        transfer_id=record.transfer_id,
        bytes=record.nbytes,
        path=record.path,
        transport=record.transport,
        duration_s=record.duration_s,
        data_plane_s=record.data_plane_s,
        device_s=record.device_s,
        mapping=record.mapping,
    )
