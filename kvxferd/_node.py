"""The daemon's state, and the acts engines, peers and operators ask of it.

One :class:`Node` per process holds the sessions, pools, offers, transfers and peers, and
hands each handoff to its room (:mod:`kvxferd.handoff`): a pull to :class:`~.handoff.pull.Pulls`
(local copy or remote pull), a peer's pull of our offer to
:class:`~.handoff.serve.TransferServer`. Its methods take checked domain values; the gRPC
services in :mod:`kvxferd.control` convert and check the wire messages first. Readers outside
the loop get a :class:`~._snapshot.NodeSnapshot`, never the live tables.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import numpy.typing as npt

from kvxfer_client._errors import InvalidRequestError, NotFoundError, PermissionDeniedError, UnavailableError
from kvxfer_client._proto import common_pb2, peer_pb2
from kvxfer_client._ticket import Ticket
from kvxfer_client._version import PROTOCOL_VERSION, __version__

from ._config import Settings
from ._faults import Faults
from ._log import log_event
from ._metrics import Metrics
from ._offers import Offer, OfferTable
from ._sessions import Session, SessionTable, check_owner, tell_landed
from ._snapshot import NodeSnapshot, OfferView, PeerView, PoolView, SnapshotHandover, StagingView
from ._transfers import TransferRecord, TransferTable
from .dataplane.cma import self_copy_works
from .dataplane.gpucopy import GpuDevices
from .dataplane.staging import StagingPool
from .dataplane.ucx import UcxTransport
from .handoff.direct import ProofSlots
from .handoff.integrity import Integrity
from .handoff.local import LocalHandoff
from .handoff.peers import PeerDirectory
from .handoff.pull import Pulls
from .handoff.push import PushHandoff
from .handoff.remote import RemotePlane
from .handoff.remote_pull import RemotePull
from .handoff.serve import OffererStream, ServeRequest, TransferServer
from .memory.pools import Pool, PoolRegistry, check_block_ids
from .tier.disk import DiskStore
from .tier.host import HostTier
from .tier.offers import TierOffers
from .tier.remote import TierPeers, load_from_peer

__all__ = ["CancelOutcome", "Node"]


@dataclass(frozen=True)
class CancelOutcome:
    """What a cancel did: ``found`` the id at all; ``cancelled`` it; UCX ``may_still_write``
    the destination of a cancelled pull; ``detail`` for an operator."""

    found: bool
    cancelled: bool
    may_still_write: bool = False
    detail: str = ""


class Node:
    def __init__(self, settings: Settings, ucx: UcxTransport | None) -> None:
        self.settings = settings
        self.faults = Faults.parse(settings.faults) if settings.fault_injection else Faults()
        if self.faults.points:
            log_event("fault.armed", logging.WARNING, points=settings.faults)
        self.daemon_id = settings.daemon_id or f"kvxferd-{socket.gethostname()}-{secrets.token_hex(4)}"
        self.started = time.time()
        self.draining = False
        self.peer_address = ""  # set once the peer listener is bound
        self.admin_address = ""
        self.lanes_address = ""
        self.ucx = ucx
        self.snapshots = SnapshotHandover(self.snapshot, _running_loop())
        self.metrics = Metrics(self.snapshots.take)
        self.pools = PoolRegistry()
        self.sessions = SessionTable()
        # A remote puller waits peer_timeout_s for "accepted": the wait for the offer must fit.
        offer_wait_s = min(settings.offer_wait_s, settings.peer_timeout_s / 2)
        if offer_wait_s < settings.offer_wait_s:
            log_event(
                "config.offer_wait_s", used=offer_wait_s, asked=settings.offer_wait_s, why="half of peer_timeout_s"
            )
        self.offers = OfferTable(
            settings.max_offers, self.sessions.tell_released, self.metrics.offer_released, offer_wait_s
        )
        self.transfers = TransferTable(settings.history, self.metrics.transfer_finished)
        self.executor = ThreadPoolExecutor(settings.copy_threads, thread_name_prefix="kvxfer-copy")
        single_pass = settings.local_single_pass and self_copy_works()
        if settings.local_single_pass and not single_pass:
            log_event(
                "local_copy.two_pass",
                logging.WARNING,
                reason="process_vm_readv on this process was refused (seccomp or kernel); "
                "local host copies go through scratch",
            )
        self.send_staging = StagingPool(settings.staging_bytes, settings.chunk_bytes)
        self.recv_staging = StagingPool(settings.staging_bytes, settings.chunk_bytes)
        self._gpu: GpuDevices | None = None  # made on first GPU use (see ``gpu``)
        #: Block checksums: digests of offers, checks at the source and where blocks land.
        self.integrity = Integrity(settings, self.executor, self.faults, self.metrics.integrity_checked)
        local = LocalHandoff(
            self.offers,
            settings.local_chunk_bytes,
            settings.copy_threads,
            self.executor,
            single_pass,
            self.gpu,
            self.faults,
            self.integrity,
        )
        #: The node's KV tier (:mod:`.tier`), when tier_host_bytes gives it memory.
        self.tier = (
            HostTier(
                settings.tier_host_bytes,
                settings.tier_high_watermark,
                settings.tier_low_watermark,
                local,
                self.metrics.tier_op_finished,
                DiskStore(settings.tier_disk_dir, self.executor) if settings.tier_disk_dir else None,
                settings.tier_disk_bytes,
                self.faults,
            )
            if settings.tier_host_bytes
            else None
        )
        #: Offers of the tier's chunks; other nodes reading this node's tier, and this node theirs.
        self.tier_offers = TierOffers(self.host_tier, self.offers, self._published)
        self.tier_peers = TierPeers(self.daemon_id, self.host_tier, self.tier_offers, 4 * settings.peer_timeout_s)
        self.pulls = Pulls(
            self.daemon_id, self.transfers, local, None, lambda pool, tid, n: tell_landed(self.sessions, pool, tid, n)
        )
        #: Push mode: Push and Receive matched on transfer ids (see :mod:`.handoff.push`).
        self.pushes = PushHandoff(self)
        #: Where same-host peers' direct-read probes are answered (see :mod:`.handoff.direct`).
        self.proofs = ProofSlots(settings.same_host_direct_read)
        # Made by start_peers(), once the peer listener's address is known:
        self.peers: PeerDirectory | None = None
        self.remote: RemotePlane | None = None
        self.server: TransferServer | None = None

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

    def start_peers(self, credentials: grpc.ChannelCredentials | None = None) -> None:
        """Start talking to peers (the peer listener is bound: our identity is complete)."""
        self.peers = PeerDirectory(self.identity(), self.settings.peer_timeout_s, credentials)
        if self.ucx is None:
            return
        s = self.settings
        self.remote = RemotePlane(s, self.ucx, self.peers, self.faults, self.send_staging, self.recv_staging, self.gpu)
        self.pulls.remote = RemotePull(
            self.daemon_id, s, self.remote, self.executor, self.gpu, self.faults, self.integrity
        )
        self.server = TransferServer(s, self.remote, self.offers, self.transfers, self.gpu, self.faults, self.integrity)

    def accept_hello(self, identity: peer_pb2.PeerIdentity) -> None:
        if self.remote is not None:
            self.remote.accept_hello(identity)
        elif self.peers is not None:
            self.peers.accept_hello(identity)
        else:
            raise UnavailableError("daemon is starting")

    # -- sessions and pools ------------------------------------------------------------------

    def open_session(self, engine_name: str) -> Session:
        if self.draining:
            raise UnavailableError("kvxferd is draining: no new engine sessions")
        return self.sessions.open(engine_name)

    def close_session(self, session: Session) -> None:
        """The engine went away: drop its pools (and their offers) before its memory goes."""
        for pool_id in self.sessions.close(session):
            self.deregister_pool(pool_id, common_pb2.RELEASE_REASON_POOL_GONE)

    def register_pool(
        self, session_id: str, buffers: Sequence[common_pb2.BufferSpec], layout: common_pb2.Layout, name: str
    ) -> Pool:
        """Map an engine's buffers (checked against ``layout`` by the registry) as a pool."""
        session = self.sessions.get(session_id)
        pool = self.pools.register(session, buffers, layout, name)
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

    def owned_pool(self, pool_id: str, session_id: str) -> Pool:
        """The pool, if the calling session owns it (NOT_FOUND, PERMISSION_DENIED)."""
        pool = self.pools.get(pool_id)
        check_owner(pool.session_id, session_id, f"pool {pool_id!r}")
        return pool

    def keyed_pool(self, pool_id: str, session_id: str, offer_key: bytes) -> Pool:
        """The pool, if the caller owns it or (another session of the same engine) holds its
        offer key."""
        if not offer_key:
            return self.owned_pool(pool_id, session_id)
        pool = self.pools.get(pool_id)
        if not hmac.compare_digest(pool.offer_key, offer_key):
            raise PermissionDeniedError(f"wrong offer_key for pool {pool_id!r}")
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

    def offer(
        self,
        session_id: str,
        pool_id: str,
        block_ids: Sequence[int],
        lease_s: float,
        chosen: tuple[str, bytes] | None = None,
        offer_key: bytes = b"",
        readers: int = 1,
        layers: int = 0,
    ) -> tuple[Offer, Ticket]:
        """Pin blocks under an offer (``chosen``: the id and token the engine picked in advance;
        ``offer_key``: the pool's, when another session of its engine offers; ``readers``: the
        pulls it serves before it is released as pulled)."""
        if self.draining:
            raise UnavailableError("kvxferd is draining: no new offers")
        pool = self.keyed_pool(pool_id, session_id, offer_key)
        ids = check_block_ids(block_ids, pool.layout.num_blocks, "offer")
        offer = self.offers.create(pool, ids, lease_s, chosen, readers, layers)
        self.integrity.take_digest(offer)
        ticket = self._ticket(offer, readers)
        log_event(  # debug: one info line per handoff is transfer.done (a line costs ~5% of one)
            "offer.create",
            logging.DEBUG,
            offer_id=offer.offer_id,
            pool_id=pool.pool_id,
            blocks=len(ids),
            lease_s=lease_s,
            readers=readers,
        )
        return offer, ticket

    async def tier_offer(
        self,
        session_id: str,
        pool_id: str,
        keys: list[bytes],
        salt: bytes,
        lease_s: float,
        readers: int = 1,
        prefix: bool = False,
        offer_key: bytes = b"",
    ) -> tuple[Offer | None, Ticket | None]:
        """Offer chunks of the node's KV tier (stored under ``keys``, or with ``prefix`` the
        longest stored prefix of them, in ``pool``'s namespace): pinned in the tier until the
        offer ends, pulled like any offer; the engine's own blocks are not held (it may reuse
        them once they are stored). ``(None, None)``: a prefix of nothing."""
        if self.draining:
            raise UnavailableError("kvxferd is draining: no new offers")
        pool = self.keyed_pool(pool_id, session_id, offer_key)
        return await self.tier_offers.offer(pool, keys, salt, lease_s, readers, prefix, owner=session_id)

    async def tier_from_peer(
        self,
        session_id: str,
        pool_id: str,
        address: str,
        keys: list[bytes],
        salt: bytes,
        block_ids: Sequence[int] | None = None,
        timeout_s: float = 0.0,
    ) -> int:
        """Another node's tier (:mod:`.tier.remote`): the stored prefix of ``keys`` there, and
        given ``block_ids``, that prefix pulled into them; returns its length."""
        pool = self.owned_pool(pool_id, session_id)
        if self.peers is None or self.remote is None:
            raise UnavailableError("another node's tier is read over the data plane: UCX is not loaded here")
        ids = check_block_ids(block_ids, pool.layout.num_blocks, "tier load") if block_ids is not None else None
        if ids is not None and len(ids) != len(keys):
            raise InvalidRequestError(f"{len(keys)} keys for {len(ids)} blocks: one key per block")
        timeout = timeout_s or self.settings.pull_timeout_s

        async def pull(ticket: Ticket, into: npt.NDArray[np.int64]) -> TransferRecord:
            return await self.pull(session_id, pool_id, ticket, into.tolist(), timeout)

        peers = self.peers
        return await load_from_peer(
            self.tier_peers, peers.dial, pull, address, pool, ids, keys, salt, self.settings.peer_timeout_s
        )

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
            pool = offer.pool
            if pool.session_id != session_id and not (offer_key and hmac.compare_digest(pool.offer_key, offer_key)):
                raise PermissionDeniedError(f"offer {offer_id!r} is another engine session's")
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

    async def pull(
        self,
        session_id: str,
        pool_id: str,
        ticket: Ticket,
        block_ids: Sequence[int],
        timeout_s: float,
        transfer_id: str = "",
        offer_block_indices: npt.NDArray[np.int64] | None = None,
        pushed_by: str = "",
    ) -> TransferRecord:
        if self.draining:
            raise UnavailableError("kvxferd is draining: no new pulls")
        pool = self.owned_pool(pool_id, session_id)
        ids = check_block_ids(block_ids, pool.layout.num_blocks, "pull destination")
        return await self.pulls.pull(ticket, pool, ids, timeout_s, transfer_id, offer_block_indices, pushed_by)

    async def serve(self, start: ServeRequest, stream: OffererStream) -> None:
        if self.server is None:
            raise UnavailableError("the UCX data plane is not available on this daemon")
        await self.server.serve(start, stream)

    async def cancel(self, target_id: str, session_id: str | None = None) -> CancelOutcome:
        """Cancel a running transfer (our pull, or a peer's pull of our offer: the peer then
        sees its pull fail), or release an offer nobody is pulling. ``session_id``: an engine
        acts only on its own pools' transfers and offers (None: an operator)."""
        if self.pushes.table.cancel(target_id, session_id):
            return CancelOutcome(True, True, detail="receive cancelled before its push came")
        records = self.transfers.find(target_id)
        if records:
            if session_id is not None:
                owners = {self.pools.pools[p].session_id for r in records for p in r.pools if p in self.pools.pools}
                if session_id not in owners:
                    raise PermissionDeniedError(f"transfer {target_id!r} touches no pool of this engine session")
            unconfirmed = self._unconfirmed_receives()
            detail = f"transfer {target_id} was cancelled on daemon {self.daemon_id}"
            stuck = await self.transfers.cancel(records, detail, self.settings.peer_timeout_s)
            may_still_write = stuck or self._unconfirmed_receives() > unconfirmed
            note = " (UCX may still write its destination)" if may_still_write else ""
            return CancelOutcome(True, True, may_still_write, "transfer cancelled" + note)
        offer = self.offers.offers.get(target_id)
        if offer is None:
            return CancelOutcome(False, False, detail=f"no running transfer or live offer {target_id!r}")
        if offer.state != "offered":
            return CancelOutcome(True, False, detail="offer is being pulled; cancel its transfer")
        by = "an operator" if session_id is None else "the engine"
        self.offers.release_unpulled(target_id, common_pb2.RELEASE_REASON_CANCELLED, f"cancelled by {by}", session_id)
        return CancelOutcome(True, True, detail="offer released")

    def _unconfirmed_receives(self) -> int:
        return self.ucx.receives_unconfirmed if self.ucx is not None else 0

    def shutdown(self) -> None:
        """Release every offer and drop every pool (the daemon is exiting)."""
        self.offers.release_all(common_pb2.RELEASE_REASON_SHUTDOWN, "daemon shutting down")
        for pool_id in list(self.pools.pools):
            self.deregister_pool(pool_id, common_pb2.RELEASE_REASON_SHUTDOWN)
        if self.tier is not None:
            self.tier.close()

    def host_tier(self) -> HostTier:
        """The tier, or the error that says how to turn it on."""
        if self.tier is None:
            raise UnavailableError("the node's KV tier is off: give it memory with tier_host_bytes")
        return self.tier

    # -- what readers outside the core see ---------------------------------------------------

    def snapshot(self, history: bool = False) -> NodeSnapshot:
        """The node's state as one immutable picture (call on the event loop); ``history``
        adds copies of the recently finished transfers (up to ``settings.history``)."""
        now, t = time.time(), self.transfers
        return NodeSnapshot(
            daemon_id=self.daemon_id,
            draining=self.draining,
            version=__version__,
            uptime_s=now - self.started,
            engine_socket=self.settings.engine_socket,
            peer_address=self.peer_address,
            admin_address=self.admin_address,
            lanes_address=self.lanes_address,
            tier_limit_bytes=self.tier.index.limit_bytes if self.tier else 0,
            tier_used_bytes=self.tier.index.used_bytes if self.tier else 0,
            tier_disk_limit_bytes=self.tier.index.disk_limit_bytes if self.tier else 0,
            tier_disk_used_bytes=self.tier.index.disk_used_bytes if self.tier else 0,
            tier=self.tier.views() if self.tier else (),
            ucx_transports=tuple(self.ucx.transports) if self.ucx else (),
            sessions=len(self.sessions),
            pools=tuple(PoolView.of(p, self.sessions.find(p.session_id)) for p in self.pools.pools.values()),
            offers=tuple(OfferView.of(o, now) for o in self.offers.offers.values()),
            transfers=tuple(copy.copy(r) for r in t.active.values()),
            finished=tuple(copy.copy(r) for r in t.finished) if history else (),
            peers=tuple(PeerView.of(p) for p in (self.peers.by_id.values() if self.peers else ())),
            transfers_succeeded=t.succeeded,
            transfers_failed=t.failed,
            bytes_moved=t.bytes_moved,
            lease_expiries=self.offers.expiries,
            staging=self._staging(),
            ucx_endpoints=self.ucx.endpoint_count if self.ucx else 0,
            ucx_receives_unconfirmed=self._unconfirmed_receives(),
            data_plane_detail=self.data_plane_detail,
        )

    def _staging(self) -> dict[str, StagingView]:
        def view(pools: list[StagingPool], size: int) -> StagingView:
            return StagingView(
                sum(p.in_use for p in pools), sum(p.allocated for p in pools), sum(p.capacity for p in pools), size
            )

        state = {
            "send": view([self.send_staging], self.send_staging.buffer_bytes),
            "receive": view([self.recv_staging], self.recv_staging.buffer_bytes),
        }
        if self._gpu is not None:
            for direction in ("send", "receive"):
                gpu_pools = self._gpu.staging_pools(direction)
                if gpu_pools:
                    state["gpu_" + direction] = view(gpu_pools, self._gpu.buffer_bytes)
        return state


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
