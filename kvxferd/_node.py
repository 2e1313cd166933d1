"""The daemon's state, and the acts engines, peers and operators ask of it.

One :class:`Node` per process holds the sessions, pools, offers, transfers and peers, and
hands each handoff to its room (:mod:`kvxferd.handoff`): a pull to :class:`~.handoff.pull.Pulls`
(local copy or remote pull), a peer's pull of our offer to
:class:`~.handoff.serve.TransferServer`. Its methods take checked domain values; the gRPC
services in :mod:`kvxferd.control` convert and check the wire messages first. Readers outside
the loop get a :class:`~._snapshot.NodeSnapshot`, never the live tables. Every act an engine
starts passes :class:`~._admission.Admission` first (draining, whose pools).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvxfer.errors import NotFoundError, UnavailableError
from kvxfer.proto import common_pb2, peer_pb2
from kvxfer.ticket import Ticket
from kvxfer.tls import TlsFiles
from kvxfer.version import PROTOCOL_VERSION, __version__

from ._admission import Admission
from ._asks import OfferAsk, PullAsk
from ._cancel import CancelOutcome, cancel
from ._config import Settings
from ._faults import Faults
from ._integrity import Integrity
from ._log import log_event
from ._metrics import Metrics
from ._offers import Offer, OfferTable
from ._parts import local_handoff, node_tier, offer_wait_s
from ._services import Services
from ._sessions import Session, SessionTable, tell_landed
from ._snapshot import NodeSnapshot, SnapshotHandover, node_snapshot
from ._transfers import TransferRecord, TransferTable
from .dataplane.gpucopy import GpuDevices
from .dataplane.staging import StagingPool
from .dataplane.ucx import UcxTransport
from .fleet import Registry
from .fleet.record import own_record
from .handoff.pull import Pulls
from .handoff.push import PushHandoff
from .handoff.remote_pull import RemotePull
from .handoff.serve import TransferServer
from .memory.block_ids import check_block_ids
from .memory.cuda_ipc import gpu_support
from .memory.pools import Pool, PoolIdentity, PoolRegistry
from .peer.directory import PeerDirectory
from .peer.serve_request import OffererStream, ServeRequest
from .tier.acts import KvTier
from .transports.direct_proof import ProofSlots
from .transports.plane import RemotePlane

__all__ = ["Addresses", "Node"]


@dataclass(frozen=True)
class Addresses:
    """Where the daemon's listeners are bound (all bound before the node is built)."""

    #: The address peers reach this daemon at (``peer_advertise``, else the bound one).
    peer: str
    admin: str = ""
    #: Where TCP lanes listen ("": no lanes).
    lanes_listen: str = ""


class Node:
    def __init__(
        self,
        settings: Settings,
        ucx: UcxTransport | None,
        addresses: Addresses,
        tls: TlsFiles | None = None,
    ) -> None:
        """Build every part of the daemon, once (``_wiring`` binds the listeners first, so
        every address is known). Raises OSError or ValueError when the TCP lanes cannot
        listen at ``addresses.lanes_listen``."""
        self.settings = settings
        self.faults = Faults.parse(settings.faults) if settings.fault_injection else Faults()
        if self.faults.points:
            log_event("fault.armed", logging.WARNING, points=settings.faults)
        self.daemon_id = settings.daemon_id or f"kvxferd-{socket.gethostname()}-{secrets.token_hex(4)}"
        self.started = time.time()
        self.peer_address = addresses.peer
        self.admin_address = addresses.admin
        self.ucx = ucx
        self.snapshots = SnapshotHandover(self.snapshot, _running_loop())
        self.metrics = Metrics(self.snapshots.take)
        self.pools = PoolRegistry()
        #: Whether the node takes new work, and which pools a caller may touch.
        self.admission = Admission(self.pools)
        self.sessions = SessionTable()
        self.offers = OfferTable(
            settings.max_offers, self.sessions.tell_released, self.metrics.offer_released, offer_wait_s(settings)
        )
        self.transfers = TransferTable(settings.history, self.metrics.transfer_finished)
        self.executor = ThreadPoolExecutor(settings.copy_threads, thread_name_prefix="kvxfer-copy")
        self.send_staging = StagingPool(settings.staging_bytes, settings.chunk_bytes)
        self.recv_staging = StagingPool(settings.staging_bytes, settings.chunk_bytes)
        self._gpu: GpuDevices | None = None  # made on first GPU use (see ``gpu``)
        #: Block checksums: digests of offers, checks at the source and where blocks land.
        self.integrity = Integrity(
            settings, self.executor, self.faults, self.metrics.integrity_checked, self.metrics.integrity_spent
        )
        self.services = Services(settings, self.executor, self.gpu, self.faults, self.integrity)
        local = local_handoff(self.services, self.offers)
        #: The node's KV tier (:mod:`.tier`), when tier_host_bytes gives it memory.
        self.tier = node_tier(self.services, local, self.metrics.tier_op_finished)
        #: The tier as engines and peers ask for it (offers of its chunks, other nodes' tiers).
        self.kv_tier = KvTier(self, self._published)
        #: Where same-host peers' direct-read probes are answered (see :mod:`.transports.direct_proof`).
        self.proofs = ProofSlots(settings.same_host_direct_read)
        #: The fleet registry (None without one): our record, and the other daemons' addresses.
        self.registry: Registry | None = None
        if settings.registry:
            record = own_record(
                settings,
                self.daemon_id,
                (addresses.peer, addresses.admin),
                self.identity().ucx_transports,
                0 if gpu_support() else 1,
            )
            self.registry = Registry(settings, tls, record, self.peer_left, self.faults)
        credentials = tls.channel_credentials() if tls else None
        self.peers = PeerDirectory(self.identity(), settings.peer_timeout_s, credentials, self.registry)
        #: The remote data plane and both its ends (all None without UCX: local handoffs only).
        self.remote: RemotePlane | None = None
        self.server: TransferServer | None = None
        remote_pull: RemotePull | None = None
        self.lanes_address = ""
        if ucx is not None:
            self.remote = RemotePlane(self.services, ucx, self.peers, (self.send_staging, self.recv_staging))
            remote_pull = RemotePull(self.daemon_id, self.services, self.remote)
            self.server = TransferServer(self.services, self.remote, self.offers, self.transfers)
            if addresses.lanes_listen:
                self.lanes_address = self.remote.start_lanes(addresses.lanes_listen)
        self.pulls = Pulls(
            self.daemon_id,
            self.transfers,
            local,
            remote_pull,
            lambda pool, tid, n: tell_landed(self.sessions, pool, tid, n),
        )
        #: Push mode: Push and Receive matched on transfer ids (see :mod:`.handoff.push`).
        self.pushes = PushHandoff(self)

    @property
    def draining(self) -> bool:
        return self.admission.draining

    def gpu(self) -> GpuDevices:
        """Per-GPU copiers and staging, made when the first GPU pool moves bytes."""
        if self._gpu is None:
            self._gpu = GpuDevices(self.settings.gpu_staging_bytes, self.settings.gpu_chunk_bytes)
        return self._gpu

    @property
    def data_plane_ok(self) -> bool:
        """Whether remote transfers can run: UCX loaded and its worker progressing."""
        return self.ucx is not None and self.ucx.healthy

    @property
    def data_plane_detail(self) -> str:
        """Why remote transfers cannot run ("" when they can)."""
        if self.ucx is None:
            if not self.settings.ucx_enabled:
                return "ucx_enabled is off: local handoffs only"
            return "UCX is not installed: install kvxfer[ucx] (or a cu12/cu13 extra) for remote handoffs"
        if not self.ucx.healthy:
            return "the UCX worker stopped progressing: restart the daemon"
        return ""

    # -- identity and peers ------------------------------------------------------------------

    def identity(self) -> peer_pb2.PeerIdentity:
        return peer_pb2.PeerIdentity(
            daemon_id=self.daemon_id,
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            hostname=socket.gethostname(),
            ucx_worker_address=self.ucx.worker_address if self.ucx else b"",
            ucx_transports=self.ucx.transports if self.ucx else [],
            peer_address=self.peer_address,
            ucx_error_handling=self.settings.ucx_error_handling,
        )

    def peer_left(self, daemon_id: str, why: str) -> None:
        """The registry lost the daemon's record: what runs with it fails now (typed, as if its
        stream broke), and no new pull dials it until it registers again."""
        gone = UnavailableError(f"peer {daemon_id!r} left cluster {self.settings.cluster!r}: {why}")
        if self.remote is not None:
            self.remote.forget_peer(daemon_id, gone)
        self.transfers.abort_all(str(gone), where=lambda r: r.role == "prefill" and r.peer_daemon_id == daemon_id)

    def accept_hello(self, identity: peer_pb2.PeerIdentity) -> None:
        if self.remote is not None:
            self.remote.accept_hello(identity)
        else:
            self.peers.accept_hello(identity)

    # -- sessions and pools ------------------------------------------------------------------

    def open_session(self, engine_name: str) -> Session:
        self.admission.admit("engine sessions")
        return self.sessions.open(engine_name)

    def close_session(self, session: Session) -> None:
        """The engine went away: drop its pools (and their offers) before its memory goes."""
        for pool_id in self.sessions.close(session):
            self.deregister_pool(pool_id, common_pb2.RELEASE_REASON_POOL_GONE)

    def register_pool(
        self,
        session_id: str,
        buffers: Sequence[common_pb2.BufferSpec],
        layout: common_pb2.Layout,
        name: str,
        keep: PoolIdentity | None = None,
    ) -> Pool:
        """Map an engine's buffers (checked against ``layout`` by the registry) as a pool;
        ``keep``: its id and offer key from before a restart (see ``PoolRegistry.register``)."""
        session = self.sessions.get(session_id)
        pool = self.pools.register(session, buffers, layout, name, keep)
        session.pools.add(pool.pool_id)
        log_event(
            "pool.register",
            pool_id=pool.pool_id,
            session=session.label,
            bytes=pool.nbytes,
            num_blocks=pool.layout.num_blocks,
            regions=len(pool.layout.regions),
            fingerprint=pool.fingerprint,
        )
        return pool

    def deregister_pool(
        self, pool_id: str, reason: common_pb2.ReleaseReason.ValueType = common_pb2.RELEASE_REASON_POOL_GONE
    ) -> int:
        """Release the pool's offers, cancel transfers touching it, unmap it once none does."""
        pool = self.pools.get(pool_id)
        released = self.offers.release_all(reason, "pool deregistered", pool_id=pool_id)
        self.transfers.abort_all(
            f"pool {pool_id} was deregistered on {self.daemon_id}", where=lambda r: pool_id in r.pools
        )
        self.pools.remove(pool_id)
        session = self.sessions.find(pool.session_id)
        if session is not None:
            session.pools.discard(pool_id)
        pool.close_when_idle()
        log_event("pool.deregister", pool_id=pool_id, released_offers=released, busy=pool.busy)
        return released

    # -- offers ------------------------------------------------------------------------------

    def offer(self, ask: OfferAsk) -> tuple[Offer, Ticket]:
        """Pin blocks under an offer (see :class:`~._asks.OfferAsk`)."""
        self.admission.admit("offers")
        pool = self.admission.keyed_pool(ask.pool_id, ask.session_id, ask.offer_key)
        ids = check_block_ids(ask.block_ids, pool.layout.num_blocks, "offer")
        if pool.process is not None:  # the engine's own memory: still there to be read?
            pool.process.probe(pool.range_ends)
        offer = self.offers.create(pool, ids, ask.lease_s, ask.chosen, ask.readers, ask.layers)
        self.integrity.take_digest(offer)
        ticket = self._ticket(offer, ask.readers)
        log_event(  # debug: one info line per handoff is transfer.done (a line costs ~5% of one)
            "offer.create",
            logging.DEBUG,
            offer_id=offer.offer_id,
            pool_id=pool.pool_id,
            blocks=len(ids),
            lease_s=ask.lease_s,
            readers=ask.readers,
        )
        return offer, ticket

    def _published(self, offer: Offer, readers: int) -> Ticket:
        """An offer made outside :meth:`offer` (the tier's): its digest, logged, its ticket."""
        self.integrity.take_digest(offer)
        log_event("offer.create", logging.DEBUG, offer_id=offer.offer_id, pool_id=offer.pool.pool_id)
        return self._ticket(offer, readers)

    def _ticket(self, offer: Offer, readers: int) -> Ticket:
        return Ticket(
            daemon_id=self.daemon_id,
            peer_address=self.peer_address,
            offer_id=offer.offer_id,
            token=offer.token,
            num_blocks=len(offer.block_ids),
            fingerprint=offer.pool.fingerprint,
            total_bytes=offer.nbytes,
            readers=readers,
        )

    def layers_ready(self, session_id: str, offer_ids: Sequence[str], layers: int, offer_key: bytes = b"") -> None:
        """The engine wrote the first ``layers`` layers of these layer-wise offers. Offers that
        ended already are passed over (their pull committed or failed); unknown ones refused."""
        for offer_id in offer_ids:
            offer = self.offers.offers.get(offer_id)
            if offer is None:
                if not self.offers.ended(offer_id):
                    raise NotFoundError(f"no offer {offer_id!r}")
                continue
            self.admission.check_offerer(offer.pool, session_id, offer_key, f"offer {offer_id!r}")
            offer.mark_ready(layers)
            self.integrity.take_digest(offer)  # once the last layer is written: what was offered

    def release(self, offer_id: str, session_id: str) -> None:
        """The engine releases its own offer before anyone pulled it."""
        self.offers.release_unpulled(
            offer_id, common_pb2.RELEASE_REASON_CANCELLED, "released by the engine", owner=session_id
        )

    async def extend_lease(self, ticket: Ticket, lease_s: float) -> float:
        """Extend an offer's lease on the daemon that made it; returns seconds left."""
        if ticket.daemon_id == self.daemon_id:
            return self.offers.extend(ticket.offer_id, ticket.token, lease_s)
        if self.remote is None:
            raise UnavailableError("the UCX data plane is not available: no remote offers")
        return await self.remote.extend_lease(ticket, lease_s)

    # -- transfers ---------------------------------------------------------------------------

    async def pull(self, ask: PullAsk) -> TransferRecord:
        """Pull a ticket into blocks of an engine's own pool (see :class:`~._asks.PullAsk`)."""
        self.admission.admit("pulls")
        pool = self.admission.owned_pool(ask.pool_id, ask.session_id)
        ids = check_block_ids(ask.block_ids, pool.layout.num_blocks, "pull destination")
        return await self.pulls.run_pull(ask, pool, ids)

    # -- what peers ask (see peer.serve_request.PeerNode) ------------------------------------

    async def serve(self, start: ServeRequest, stream: OffererStream) -> None:
        if self.server is None:
            raise UnavailableError("the UCX data plane is not available on this daemon")
        await self.server.serve(start, stream)

    def write_proof(self, nonce: bytes) -> tuple[int, int]:
        return self.proofs.write(nonce)

    async def serve_tier_offer(self, request: peer_pb2.PeerTierOfferRequest) -> peer_pb2.PeerTierOfferResponse:
        return await self.kv_tier.peers.serve(request)

    def push_announced(self, transfer_id: str, ticket: Ticket, lease_s: float, daemon_id: str) -> bool:
        return self.pushes.announced(transfer_id, ticket, lease_s, daemon_id)

    async def cancel(self, target_id: str, session_id: str | None = None) -> CancelOutcome:
        """Cancel a running transfer or release an offer nobody is pulling (see :func:`._cancel.cancel`)."""
        return await cancel(self, target_id, session_id)

    def unconfirmed_receives(self) -> int:
        return self.ucx.receives_unconfirmed if self.ucx is not None else 0

    def shutdown(self) -> None:
        """Release every offer and drop every pool (the daemon is exiting)."""
        self.offers.release_all(common_pb2.RELEASE_REASON_SHUTDOWN, "daemon shutting down")
        for pool_id in list(self.pools.pools):
            self.deregister_pool(pool_id, common_pb2.RELEASE_REASON_SHUTDOWN)
        if self.tier is not None:
            self.tier.close()

    # -- what readers outside the core see ---------------------------------------------------

    def snapshot(self, history: bool = False) -> NodeSnapshot:
        """The node's state as one immutable picture (call on the event loop); ``history``
        adds copies of the recently finished transfers (up to ``settings.history``)."""
        return node_snapshot(self, history)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
