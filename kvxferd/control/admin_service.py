"""AdminService: the operators' view (kvxferctl), on the Unix socket and the admin port."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from typing import Any

from kvxfer.errors import NotFoundError, PermissionDeniedError
from kvxfer.proto import admin_pb2, admin_pb2_grpc

from .._node import Node
from ..edge.rpc import rpc_method

Ctx = Any  # grpc.aio.ServicerContext


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    """Read calls everywhere; Cancel and Drain only where ``allow_changes``: the Unix socket
    (whose file mode and group decide who may connect) and the TCP port when it requires mTLS.
    The plaintext TCP port is read-only."""

    def __init__(self, node: Node, request_drain: Any, *, allow_changes: bool) -> None:
        self.node = node
        self._request_drain = request_drain
        self._allow_changes = allow_changes

    def _check_changes_allowed(self, what: str) -> None:
        if not self._allow_changes:
            raise PermissionDeniedError(f"{what} is accepted only on the daemon's Unix socket or over mTLS")

    @rpc_method
    async def Status(self, request: admin_pb2.StatusRequest, context: Ctx) -> admin_pb2.StatusResponse:  # noqa: N802
        s = self.node.snapshot()
        return admin_pb2.StatusResponse(
            daemon_id=s.daemon_id,
            version=s.version,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            uptime_s=s.uptime_s,
            draining=s.draining,
            engine_socket=s.engine_socket,
            peer_address=s.peer_address,
            admin_address=s.admin_address,
            lanes_address=s.lanes_address,
            ucx_transports=s.ucx_transports,
            sessions=s.sessions,
            pools=len(s.pools),
            registered_bytes=s.registered_bytes,
            active_offers=s.offer_count,
            active_transfers=len(s.transfers),
            peers=len(s.peers),
            transfers_succeeded=s.transfers_succeeded,
            transfers_failed=s.transfers_failed,
            bytes_moved=s.bytes_moved,
            lease_expiries=s.lease_expiries,
            staging_send_in_use=s.staging["send"].in_use,
            staging_receive_in_use=s.staging["receive"].in_use,
            ucx_endpoints=s.ucx_endpoints,
            ucx_receives_unconfirmed=s.ucx_receives_unconfirmed,
            data_plane_serving=not s.data_plane_detail,
            data_plane_detail=s.data_plane_detail,
            registry=s.registry.url,
            cluster=s.registry.cluster,
            registry_state=s.registry.state,
            registry_detail=s.registry.detail,
            registry_nodes=s.registry.nodes,
        )

    @rpc_method
    async def ListPools(self, request: admin_pb2.ListPoolsRequest, context: Ctx) -> admin_pb2.ListPoolsResponse:  # noqa: N802
        return admin_pb2.ListPoolsResponse(
            pools=[
                admin_pb2.PoolInfo(
                    pool_id=p.pool_id,
                    name=p.name,
                    session_id=p.session_label,
                    engine_name=p.engine_name,
                    kind=p.kind,  # type: ignore[arg-type]
                    buffers=p.buffers,
                    bytes=p.nbytes,
                    num_blocks=p.num_blocks,
                    regions=p.regions,
                    fingerprint=p.fingerprint,
                    device=p.device,
                    active_offers=p.active_offers,
                )
                for p in self.node.snapshot().pools
            ]
        )

    @rpc_method
    async def ListOffers(self, request: admin_pb2.ListOffersRequest, context: Ctx) -> admin_pb2.ListOffersResponse:  # noqa: N802
        return admin_pb2.ListOffersResponse(
            offers=[
                admin_pb2.OfferInfo(
                    offer_id=o.offer_id,
                    pool_id=o.pool_id,
                    num_blocks=o.num_blocks,
                    bytes=o.nbytes,
                    lease_remaining_s=o.lease_remaining_s,
                    state=o.state,
                )
                for o in self.node.snapshot().offers
            ]
        )

    @rpc_method
    async def ListTransfers(  # noqa: N802
        self, request: admin_pb2.ListTransfersRequest, context: Ctx
    ) -> admin_pb2.ListTransfersResponse:
        s = self.node.snapshot(history=request.include_finished)
        records = s.transfers + s.finished
        return admin_pb2.ListTransfersResponse(transfers=[r.to_proto() for r in records])

    @rpc_method
    async def ListTier(self, request: admin_pb2.ListTierRequest, context: Ctx) -> admin_pb2.ListTierResponse:  # noqa: N802
        s = self.node.snapshot()
        return admin_pb2.ListTierResponse(
            limit_bytes=s.tier_limit_bytes,
            used_bytes=s.tier_used_bytes,
            disk_limit_bytes=s.tier_disk_limit_bytes,
            disk_used_bytes=s.tier_disk_used_bytes,
            namespaces=[
                admin_pb2.TierNamespaceInfo(
                    namespace=t.namespace,
                    label=t.label,
                    chunks=t.chunks,
                    bytes=t.bytes,
                    hits=t.hits,
                    misses=t.misses,
                    evictions=t.evictions,
                    disk_chunks=t.disk_chunks,
                    disk_bytes=t.disk_bytes,
                    disk_hits=t.disk_hits,
                    disk_evictions=t.disk_evictions,
                    disk_failures=t.disk_failures,
                )
                for t in s.tier
            ],
        )

    @rpc_method
    async def WatchTier(  # noqa: N802
        self, request: admin_pb2.WatchTierRequest, context: Ctx
    ) -> AsyncIterator[admin_pb2.TierEventBatch]:
        async for batch in self.node.kv_tier.host().events.subscribe():
            yield batch

    @rpc_method
    async def ListPeers(self, request: admin_pb2.ListPeersRequest, context: Ctx) -> admin_pb2.ListPeersResponse:  # noqa: N802
        return admin_pb2.ListPeersResponse(
            peers=[
                admin_pb2.PeerInfo(
                    daemon_id=p.daemon_id,
                    address=p.address,
                    hostname=p.hostname,
                    version=p.version,
                    state=p.state,
                    ucx_transports=p.ucx_transports,
                    last_hello_unix=p.last_hello,
                )
                for p in self.node.snapshot().peers
            ]
        )

    @rpc_method
    async def Cancel(self, request: admin_pb2.AdminCancelRequest, context: Ctx) -> admin_pb2.AdminCancelResponse:  # noqa: N802
        self._check_changes_allowed("Cancel")
        outcome = await self.node.cancel(request.id)
        if not outcome.found:
            raise NotFoundError(outcome.detail)
        return admin_pb2.AdminCancelResponse(cancelled=outcome.cancelled, detail=outcome.detail)

    @rpc_method
    async def Drain(self, request: admin_pb2.DrainRequest, context: Ctx) -> admin_pb2.DrainResponse:  # noqa: N802
        self._check_changes_allowed("Drain")
        self._request_drain()
        return admin_pb2.DrainResponse(draining=True)
