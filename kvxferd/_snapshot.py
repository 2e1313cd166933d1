"""One consistent, immutable picture of a daemon's state, for readers outside the core.

The node builds a :class:`NodeSnapshot` on the event loop (:meth:`Node.snapshot`); the admin
service's ``Status``/``List*`` answer from it and the metrics scrape, on its own thread, reads
one handed over by the loop. Neither walks the node's live tables, which change under a
reader on another thread.

>>> snap = NodeSnapshot(daemon_id="d", draining=False)
>>> snap.offer_count, snap.transfers_by_role()
(0, {})
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvxfer.host_memory import MEMORY_KIND_NAMES
from kvxfer.version import __version__

from .fleet.view import RegistryView
from .tier.views import TierView

if TYPE_CHECKING:
    from ._config import Settings
    from ._offers import Offer, OfferTable
    from ._sessions import Session, SessionTable
    from ._transfers import TransferRecord, TransferTable
    from .dataplane.gpucopy import GpuDevices
    from .dataplane.staging import StagingPool
    from .dataplane.ucx import UcxTransport
    from .fleet.registry import Registry
    from .memory.pools import Pool, PoolRegistry
    from .peer.directory import Peer, PeerDirectory
    from .tier.host import HostTier

__all__ = ["NodeSnapshot", "OfferView", "PeerView", "PoolView", "SnapshotHandover", "StagingView", "TierView"]


@dataclass(frozen=True)
class PoolView:
    pool_id: str
    name: str
    session_label: str
    engine_name: str
    kind: int
    #: "host" or "cuda" (a metrics label).
    memory_kind: str
    device: str
    buffers: int
    nbytes: int
    num_blocks: int
    regions: int
    fingerprint: str
    active_offers: int

    @classmethod
    def of(cls, p: Pool, session: Session | None) -> PoolView:
        return cls(
            pool_id=p.pool_id,
            name=p.name,
            session_label=session.label if session else "",
            engine_name=session.engine_name if session else "",
            kind=p.kind,
            memory_kind=MEMORY_KIND_NAMES.get(p.kind, "unknown"),
            device=p.device_name,
            buffers=len(p.layout.buffer_sizes()),
            nbytes=p.nbytes,
            num_blocks=p.layout.num_blocks,
            regions=len(p.layout.regions),
            fingerprint=p.fingerprint,
            active_offers=len(p.offers),
        )


@dataclass(frozen=True)
class OfferView:
    offer_id: str
    pool_id: str
    num_blocks: int
    nbytes: int
    lease_remaining_s: float
    state: str

    @classmethod
    def of(cls, o: Offer, now: float) -> OfferView:
        return cls(o.offer_id, o.pool.pool_id, len(o.block_ids), o.nbytes, max(0.0, o.deadline - now), o.state)


@dataclass(frozen=True)
class PeerView:
    daemon_id: str
    address: str
    hostname: str
    version: str
    state: str
    ucx_transports: tuple[str, ...]
    last_hello: float

    @classmethod
    def of(cls, p: Peer) -> PeerView:
        i = p.identity
        return cls(p.daemon_id, i.peer_address, i.hostname, i.version, p.state, tuple(i.ucx_transports), p.last_hello)


@dataclass(frozen=True)
class StagingView:
    """Buffers of one direction's staging (GPU staging summed over GPUs)."""

    in_use: int
    allocated: int
    limit: int
    buffer_bytes: int


@dataclass(frozen=True)
class NodeSnapshot:
    daemon_id: str
    draining: bool
    version: str = ""
    uptime_s: float = 0.0
    engine_socket: str = ""
    peer_address: str = ""
    admin_address: str = ""
    lanes_address: str = ""
    tier_limit_bytes: int = 0
    tier_used_bytes: int = 0
    tier_disk_limit_bytes: int = 0
    tier_disk_used_bytes: int = 0
    tier: tuple[TierView, ...] = ()
    ucx_transports: tuple[str, ...] = ()
    sessions: int = 0
    pools: tuple[PoolView, ...] = ()
    offers: tuple[OfferView, ...] = ()
    #: Copies of the running transfers' records, then of the recently finished ones (only
    #: in a snapshot taken with ``history``).
    transfers: tuple[TransferRecord, ...] = ()
    finished: tuple[TransferRecord, ...] = ()
    peers: tuple[PeerView, ...] = ()
    transfers_succeeded: int = 0
    transfers_failed: int = 0
    bytes_moved: int = 0
    lease_expiries: int = 0
    #: "send", "receive", and "gpu_send"/"gpu_receive" once a GPU pool moved bytes.
    staging: dict[str, StagingView] = field(default_factory=dict)
    ucx_endpoints: int = 0
    ucx_receives_unconfirmed: int = 0
    #: Why remote handoffs cannot run ("" when they can).
    data_plane_detail: str = ""
    #: The fleet registry as this daemon sees it (state "off" without one).
    registry: RegistryView = field(default_factory=RegistryView)

    @property
    def offer_count(self) -> int:
        return len(self.offers)

    @property
    def registered_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def transfers_by_role(self) -> dict[str, int]:
        return dict(Counter(r.role for r in self.transfers))

    def pool_bytes(self) -> dict[tuple[str, str], int]:
        """``(memory kind, device) -> bytes`` of registered pools."""
        totals: Counter[tuple[str, str]] = Counter()
        for p in self.pools:
            totals[(p.memory_kind, p.device)] += p.nbytes
        return dict(totals)

    def peers_by_state(self) -> dict[str, int]:
        return dict(Counter(p.state for p in self.peers))


#: How long the metrics thread waits for the loop's snapshot before it serves the last one.
HANDOVER_WAIT_S = 2.0


class SnapshotHandover:
    """Hands snapshots built on the event loop to another thread (the metrics scrape)."""

    def __init__(self, build: Callable[[], NodeSnapshot], loop: asyncio.AbstractEventLoop | None) -> None:
        self._build = build
        self._loop = loop
        self._last: NodeSnapshot | None = None

    def take(self) -> NodeSnapshot | None:
        """A fresh snapshot; the last one when the loop does not answer within
        :data:`HANDOVER_WAIT_S` (a stuck loop must not hang the scrape); None before any."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return self._last
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            return self._build()
        handed: concurrent.futures.Future[NodeSnapshot] = concurrent.futures.Future()

        def build() -> None:
            try:
                handed.set_result(self._build())
            except BaseException as exc:  # noqa: BLE001 - the scrape reports it, the loop goes on
                handed.set_exception(exc)

        try:
            loop.call_soon_threadsafe(build)
            self._last = handed.result(HANDOVER_WAIT_S)
        except (RuntimeError, concurrent.futures.TimeoutError):
            pass
        return self._last


class _Node(Protocol):
    """What a snapshot is taken of (kvxferd's Node)."""

    daemon_id: str
    started: float
    settings: Settings
    peer_address: str
    admin_address: str
    lanes_address: str
    tier: HostTier | None
    ucx: UcxTransport | None
    sessions: SessionTable
    pools: PoolRegistry
    offers: OfferTable
    transfers: TransferTable
    peers: PeerDirectory
    send_staging: StagingPool
    recv_staging: StagingPool
    _gpu: GpuDevices | None
    registry: Registry | None

    @property
    def draining(self) -> bool: ...

    @property
    def data_plane_detail(self) -> str: ...


def node_snapshot(node: _Node, history: bool = False) -> NodeSnapshot:
    """The node's state as one immutable picture (call on the event loop); ``history`` adds
    copies of the recently finished transfers (up to ``settings.history``)."""
    now, t = time.time(), node.transfers
    return NodeSnapshot(
        daemon_id=node.daemon_id,
        draining=node.draining,
        version=__version__,
        uptime_s=now - node.started,
        engine_socket=node.settings.engine_socket,
        peer_address=node.peer_address,
        admin_address=node.admin_address,
        lanes_address=node.lanes_address,
        tier_limit_bytes=node.tier.index.limit_bytes if node.tier else 0,
        tier_used_bytes=node.tier.index.used_bytes if node.tier else 0,
        tier_disk_limit_bytes=node.tier.index.disk_limit_bytes if node.tier else 0,
        tier_disk_used_bytes=node.tier.index.disk_used_bytes if node.tier else 0,
        tier=node.tier.views() if node.tier else (),
        ucx_transports=tuple(node.ucx.transports) if node.ucx else (),
        sessions=len(node.sessions),
        pools=tuple(PoolView.of(p, node.sessions.find(p.session_id)) for p in node.pools.pools.values()),
        offers=tuple(OfferView.of(o, now) for o in node.offers.offers.values()),
        transfers=tuple(copy.copy(r) for r in t.active.values()),
        finished=tuple(copy.copy(r) for r in t.finished) if history else (),
        peers=tuple(PeerView.of(p) for p in (node.peers.by_id.values() if node.peers else ())),
        transfers_succeeded=t.succeeded,
        transfers_failed=t.failed,
        bytes_moved=t.bytes_moved,
        lease_expiries=node.offers.expiries,
        staging=_staging(node),
        ucx_endpoints=node.ucx.endpoint_count if node.ucx else 0,
        ucx_receives_unconfirmed=node.ucx.receives_unconfirmed if node.ucx is not None else 0,
        data_plane_detail=node.data_plane_detail,
        registry=node.registry.view() if node.registry is not None else RegistryView(),
    )


def _staging(node: _Node) -> dict[str, StagingView]:
    def view(pools: list[StagingPool], size: int) -> StagingView:
        return StagingView(
            sum(p.in_use for p in pools), sum(p.allocated for p in pools), sum(p.capacity for p in pools), size
        )

    state = {
        "send": view([node.send_staging], node.send_staging.buffer_bytes),
        "receive": view([node.recv_staging], node.recv_staging.buffer_bytes),
    }
    if node._gpu is not None:
        for direction in ("send", "receive"):
            gpu_pools = node._gpu.staging_pools(direction)
            if gpu_pools:
                state["gpu_" + direction] = view(gpu_pools, node._gpu.buffer_bytes)
    return state
