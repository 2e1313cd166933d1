"""AdminService: the operators' view (kvxferctl), on the Unix socket and the admin port."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from kvxfer_client._errors import NotFoundError, PermissionDeniedError
from kvxfer_client._proto import admin_pb2, admin_pb2_grpc, common_pb2

from .._node import Node
from ._rpc import rpc_method

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
        n = self.node
        return admin_pb2.StatusResponse(
            daemon_id=n.daemon_id,
            version=n.identity().version,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            uptime_s=time.time() - n.started,
            draining=n.draining,
            engine_socket=n.settings.engine_socket,
            peer_address=n.peer_address,
            admin_address=n.admin_address,
            ucx_transports=n.ucx.transports if n.ucx else [],
            sessions=len(n.sessions),
            pools=len(n.pools.pools),
            registered_bytes=n.pools.registered_bytes,
            active_offers=len(n.offers.offers),
            active_transfers=len(n.transfers.active),
            peers=len(n.peers.by_id) if n.peers else 0,
            transfers_succeeded=n.transfers.succeeded,
            transfers_failed=n.transfers.failed,
            bytes_moved=n.transfers.bytes_moved,
            lease_expiries=n.lease_expiries,
            staging_send_in_use=n.send_staging.in_use,
            staging_receive_in_use=n.recv_staging.in_use,
            ucx_endpoints=n.ucx.endpoint_count if n.ucx else 0,
            ucx_receives_unconfirmed=n.ucx.iov.unconfirmed if n.ucx and n.ucx.iov else 0,
        )

    @rpc_method
    async def ListPools(self, request: admin_pb2.ListPoolsRequest, context: Ctx) -> admin_pb2.ListPoolsResponse:  # noqa: N802
        out = []
        for p in self.node.pools.pools.values():
            session = self.node.sessions.get(p.session_id)
            out.append(
                admin_pb2.PoolInfo(
                    pool_id=p.pool_id,
                    name=p.name,
                    session_id=session.label if session else "",
                    engine_name=session.engine_name if session else "",
                    kind=p.kind,  # type: ignore[arg-type]
                    buffers=len(p.layout.buffer_sizes()),
                    bytes=p.nbytes,
                    num_blocks=p.layout.num_blocks,
                    regions=len(p.layout.regions),
                    fingerprint=p.fingerprint,
                    device=p.device_name,
                    active_offers=len(p.offers),
                )
            )
        return admin_pb2.ListPoolsResponse(pools=out)

    @rpc_method
    async def ListOffers(self, request: admin_pb2.ListOffersRequest, context: Ctx) -> admin_pb2.ListOffersResponse:  # noqa: N802
        now = time.time()
        return admin_pb2.ListOffersResponse(
            offers=[
                admin_pb2.OfferInfo(
                    offer_id=o.offer_id,
                    pool_id=o.pool.pool_id,
                    num_blocks=len(o.block_ids),
                    bytes=o.nbytes,
                    lease_remaining_s=max(0.0, o.deadline - now),
                    state=o.state,
                )
                for o in self.node.offers.offers.values()
            ]
        )

    @rpc_method
    async def ListTransfers(  # noqa: N802
        self, request: admin_pb2.ListTransfersRequest, context: Ctx
    ) -> admin_pb2.ListTransfersResponse:
        records = list(self.node.transfers.active.values())
        if request.include_finished:
            records += list(self.node.transfers.finished)
        return admin_pb2.ListTransfersResponse(transfers=[r.to_proto() for r in records])

    @rpc_method
    async def ListPeers(self, request: admin_pb2.ListPeersRequest, context: Ctx) -> admin_pb2.ListPeersResponse:  # noqa: N802
        peers = self.node.peers.by_id.values() if self.node.peers else []
        return admin_pb2.ListPeersResponse(
            peers=[
                admin_pb2.PeerInfo(
                    daemon_id=p.daemon_id,
                    address=p.identity.peer_address,
                    hostname=p.identity.hostname,
                    version=p.identity.version,
                    state=p.state,
                    ucx_transports=list(p.identity.ucx_transports),
                    last_hello_unix=p.last_hello,
                )
                for p in peers
            ]
        )

    @rpc_method
    async def Cancel(self, request: admin_pb2.AdminCancelRequest, context: Ctx) -> admin_pb2.AdminCancelResponse:  # noqa: N802
        self._check_changes_allowed("Cancel")
        cancelled, may_still_write = await self.node.cancel_transfer(request.id)
        if cancelled:
            detail = "transfer cancelled" + (" (UCX may still write its destination)" if may_still_write else "")
            return admin_pb2.AdminCancelResponse(cancelled=True, detail=detail)
        offer = self.node.offers.offers.get(request.id)
        if offer is None:
            raise NotFoundError(f"no running transfer or live offer {request.id!r}")
        if offer.state != "offered":
            return admin_pb2.AdminCancelResponse(cancelled=False, detail="offer is being pulled; cancel its transfer")
        self.node.release_offer(offer, common_pb2.RELEASE_REASON_CANCELLED, "cancelled by an operator")
        return admin_pb2.AdminCancelResponse(cancelled=True, detail="offer released")

    @rpc_method
    async def Drain(self, request: admin_pb2.DrainRequest, context: Ctx) -> admin_pb2.DrainResponse:  # noqa: N802
        self._check_changes_allowed("Drain")
        self._request_drain()
        return admin_pb2.DrainResponse(draining=True)
