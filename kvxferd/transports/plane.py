"""What both sides of a remote transfer share: peers, their UCX endpoints, staging, fault points.

:class:`RemotePlane` is built once per daemon when UCX loaded. The decode side
(:mod:`.remote_pull`) and the offering side (:mod:`.serve`) take their endpoints, staging
buffers and transport names from it, so both decide them by the same rules:

* an endpoint is made from the peer's worker address once, after the address passed the
  probe child, and only when both ends agree on UCX error handling (UCX would otherwise fail
  the endpoint only when the first message arrives);
* a peer whose data plane failed is marked failed and its endpoint dropped: the next pull
  says Hello again and makes a new one;
* transfers between host pools that UCX would carry over TCP go over TCP lanes instead
  (:mod:`.lanes`), whose listener lives here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvxfer.errors import IncompatibleError, KvxferError, NotFoundError, UnavailableError
from kvxfer.proto import peer_pb2
from kvxfer.ticket import Ticket

from .._faults import Faults
from .._log import log_event
from .._services import Services
from .._steps import within
from ..dataplane.plan import SidePlan
from ..dataplane.staging import StagingPool
from ..dataplane.tcp_lanes import LaneListener
from ..dataplane.ucx import UcxTransport
from ..dataplane.ucx_setup import describe_transport
from ..memory.pools import Pool
from ..peer.directory import Peer, PeerDirectory
from .direct_proof import new_nonce, probe_peer

__all__ = ["RemotePlane", "ThreadFault", "resolve_error_handling"]


class ThreadFault:
    """The ``after_chunk_sent:N`` fault points for a thread: it waits while the point runs on
    the loop; :meth:`cancel` ends every wait (the transfer stopped: a paused lane must not
    hold its thread for the rest of the pause)."""

    def __init__(self, faults: Faults, transfer_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.faults, self.transfer_id, self.loop = faults, transfer_id, loop
        self._waits: set[concurrent.futures.Future[None]] = set()

    def __call__(self, index: int) -> None:
        point = self.faults.hit(f"after_chunk_sent:{index}", transfer_id=self.transfer_id)
        wait = asyncio.run_coroutine_threadsafe(point, self.loop)
        self._waits.add(wait)
        try:
            wait.result()
        finally:
            self._waits.discard(wait)

    def cancel(self) -> None:
        for wait in list(self._waits):
            wait.cancel()


def resolve_error_handling(setting: str, same_host: bool) -> bool:
    """Whether a ``ucx_error_handling`` setting means peer-failure handling towards a peer.

    >>> resolve_error_handling("auto", same_host=True), resolve_error_handling("auto", same_host=False)
    (False, True)
    """
    return setting == "on" or (setting == "auto" and not same_host)


class RemotePlane:
    def __init__(
        self, services: Services, ucx: UcxTransport, peers: PeerDirectory, staging: tuple[StagingPool, StagingPool]
    ) -> None:
        """``staging``: the host staging memory for sending, and for receiving."""
        self.settings = services.settings
        self.ucx = ucx
        self.peers = peers
        peers.on_new_worker = self._new_worker
        self.faults = services.faults
        self._send_staging, self._recv_staging = staging
        self._gpu = services.gpu
        self._tcp_warned: set[str] = set()
        self._lanes_told: set[str] = set()
        #: The lane port of transfers this daemon serves (None: tcp_lanes is off).
        self.lanes: LaneListener | None = None

    def start_lanes(self, address: str) -> str:
        """Listen for TCP lanes on ``host:port``; returns the address taken (OSError or
        ValueError when it cannot be)."""
        self.lanes = LaneListener(self.settings.peer_timeout_s)
        return self.lanes.start(address)

    async def close(self) -> None:
        if self.lanes is not None:
            await self.lanes.close()

    # -- peers -------------------------------------------------------------------------------

    def accept_hello(self, identity: peer_pb2.PeerIdentity) -> None:
        """A peer said Hello. One that comes back with a new worker (it restarted) gets a new
        endpoint at its next transfer (``_new_worker``, also when our Hello found it)."""
        self.peers.accept_hello(identity)

    def _new_worker(self, daemon_id: str) -> None:
        self.ucx.retire(daemon_id, "the peer came back with a new worker")

    async def dial_offerer(self, ticket: Ticket) -> Peer:
        """The daemon the ticket names, at the ticket's address. When another daemon answers
        there, ours may have restarted on that address since our Hello: say Hello again (once)."""
        peer = await self.peers.reach(ticket.daemon_id, ticket.peer_address)
        if peer.daemon_id != ticket.daemon_id:
            self.drop_peer(peer)
            peer = await self.peers.reach(ticket.daemon_id, ticket.peer_address)
        return peer

    def forget_peer(self, daemon_id: str, why: UnavailableError) -> None:
        """The daemon left the fleet: its pulls fail with ``why`` and its endpoint goes."""
        if self.peers.forget(daemon_id, why) is not None:
            self.ucx.abort_endpoint(daemon_id)

    async def direct_read_ok(self, peer: Peer) -> bool:
        """Whether pulls from ``peer`` read its memory directly: a same-host peer whose probe
        succeeded (probed once per Hello; see :mod:`.direct`)."""
        if not (self.settings.same_host_direct_read and peer.same_host):
            return False
        if peer.direct_read is None:
            nonce = new_nonce()
            try:
                proof = await peer.probe_direct_read(nonce, self.settings.peer_timeout_s)
            except KvxferError as exc:
                log_event("direct_read.off", logging.INFO, peer=peer.daemon_id, reason=str(exc))
                peer.direct_read = False
                return False
            peer.direct_read = probe_peer(proof, nonce, peer.daemon_id)
        return peer.direct_read

    def drop_peer(self, peer: Peer) -> None:
        """The peer's data plane failed: Hello again and a new endpoint at the next transfer."""
        self.peers.mark_failed(peer)
        self.ucx.abort_endpoint(peer.daemon_id)

    async def extend_lease(self, ticket: Ticket, lease_s: float) -> float:
        """Extend an offer on the daemon that made it; returns its seconds left."""
        peer = await self.dial_offerer(ticket)
        if peer.daemon_id != ticket.daemon_id:
            raise NotFoundError(f"daemon {ticket.daemon_id!r} is gone from {ticket.peer_address}: its offers with it")
        try:
            return await peer.extend_lease(ticket.offer_id, ticket.token, lease_s, self.settings.peer_timeout_s)
        except UnavailableError:
            self.drop_peer(peer)
            raise

    # -- endpoints and transports ------------------------------------------------------------

    def error_handling(self, peer: Peer) -> bool:
        """Whether endpoints to ``peer`` use UCX peer-failure handling (this side's setting)."""
        return resolve_error_handling(self.settings.ucx_error_handling, peer.same_host)

    def _agreed_error_handling(self, peer: Peer) -> bool:
        """This side's error handling towards ``peer``, once both ends are known to agree."""
        mine = self.error_handling(peer)
        theirs = peer.identity.ucx_error_handling or "auto"
        if theirs not in ("auto", "on", "off"):
            raise IncompatibleError(f"peer {peer.daemon_id} sent ucx_error_handling={theirs[:16]!r}")
        if resolve_error_handling(theirs, peer.same_host) != mine:
            raise IncompatibleError(
                f"UCX error handling towards {peer.daemon_id} is {'on' if mine else 'off'} here and "
                f"{'off' if mine else 'on'} there (ucx_error_handling {self.settings.ucx_error_handling!r} here, "
                f"{theirs!r} there): give both daemons the same ucx_error_handling"
            )
        return mine

    async def endpoint(self, peer: Peer) -> Any:
        """The UCX endpoint to ``peer`` (made from its worker address on first use)."""
        await self.faults.hit("peer_endpoint", peer=peer.daemon_id)
        ep = self.ucx.open_endpoint(peer.daemon_id)
        if ep is not None:
            return ep  # its address was probed when it was made
        address, error_handling = peer.identity.ucx_worker_address, self._agreed_error_handling(peer)
        # Bounded by the probe's own deadline: its first use may wait for the child to start.
        await self.ucx.check_address(address, error_handling, peer.daemon_id)
        ep = await within(
            self.ucx.endpoint(peer.daemon_id, address, error_handling),
            self.settings.peer_timeout_s,
            f"the UCX endpoint to {peer.daemon_id}",
        )
        log_event(
            "ucx.endpoint",
            peer=peer.daemon_id,
            transport=describe_transport(
                self.ucx.transports, list(peer.identity.ucx_transports), peer.same_host, error_handling, False
            ),
            error_handling=error_handling,
        )
        return ep

    def transport(self, peer: Peer, pool: Pool | None = None) -> str:
        """The transport bytes to ``peer`` take (for records, metrics and the log); warns once
        per peer when GPU memory would go over TCP."""
        gpu = pool is not None and pool.on_gpu
        named = peer.transports.get(gpu)
        if named is not None:  # a peer's identity and this side's settings do not change
            return named
        transport = peer.transports[gpu] = describe_transport(
            self.ucx.transports, list(peer.identity.ucx_transports), peer.same_host, self.error_handling(peer), gpu
        )
        if gpu and transport == "ucx:tcp" and peer.daemon_id not in self._tcp_warned:
            self._tcp_warned.add(peer.daemon_id)
            log_event(
                "transport.gpu_over_tcp",
                level=logging.WARNING,
                peer=peer.daemon_id,
                detail="GPU memory to this peer goes over TCP (no cuda_ipc or RDMA in common): expect a few GB/s; "
                "check UCX_TLS and that both daemons load a UCX with cuda and rdma transports",
            )
        return transport

    # -- staging and fault points ------------------------------------------------------------

    def staging_for(self, pool: Pool, plan: SidePlan | None, direction: str) -> tuple[StagingPool, int]:
        """The staging a remote transfer of ``plan`` takes on ``pool``'s side ("send" or
        "receive"), and how many buffers: GPU pools and engines' process memory stage every
        chunk; shared-memory pools stage only fragmented chunks, and none at all when UCX
        gathers sends from (scatters receives into) the pool (then ``plan`` may still be None)."""
        window = self.settings.window
        uses_iov = self.ucx.gather_send if direction == "send" else self.ucx.scatter_receive
        host_staging = self._send_staging if direction == "send" else self._recv_staging
        mapped_host = pool.device is None and pool.process is None
        if mapped_host and uses_iov:
            return host_staging, 0
        if plan is None:
            raise ValueError("a transfer that stages needs its plan first")
        if pool.device is not None:
            return self._gpu().staging(pool.device, direction), min(window, len(plan.chunks))
        if pool.process is not None:
            return host_staging, min(window, len(plan.chunks))
        return host_staging, min(window, sum(1 for c in plan.chunks if c.contiguous is None))

    def lane_staging(self, pool: Pool, plan: SidePlan, direction: str) -> tuple[StagingPool, bool]:
        """The host staging TCP lanes use on ``pool``'s side, and whether they need it (one
        buffer per lane): not when every chunk lies contiguous in memory mapped here."""
        staging = self._send_staging if direction == "send" else self._recv_staging
        staged = pool.process is not None or any(c.contiguous is None for c in plan.chunks)
        return staging, staged

    def tell_lanes_once(self, peer: Peer, count: int) -> None:
        """Log, once per peer, that its transfers go over TCP lanes (and why)."""
        if peer.daemon_id in self._lanes_told:
            return
        self._lanes_told.add(peer.daemon_id)
        why = "tcp_lanes is always" if self.settings.tcp_lanes == "always" else "UCX would use TCP to this peer"
        log_event(
            "transport.tcp_lanes",
            level=logging.WARNING if self.settings.tcp_lanes == "auto" else logging.INFO,
            peer=peer.daemon_id,
            lanes=count,
            detail=f"host memory to this peer goes over {count} TCP lanes ({why}: no shared memory or RDMA in "
            "common); check UCX_TLS and the NICs if RDMA was expected",
        )

    def chunk_fault_in_thread(self, transfer_id: str) -> ThreadFault | None:
        """:meth:`chunk_fault` for lane threads (None when none is armed)."""
        if self.chunk_fault(transfer_id) is None:
            return None
        return ThreadFault(self.faults, transfer_id, asyncio.get_running_loop())

    def chunk_fault(self, transfer_id: str) -> Callable[[int], Awaitable[None]] | None:
        """The ``after_chunk_sent:N`` fault points as a send hook (None when none is armed)."""
        if not any(p.startswith("after_chunk_sent:") for p in self.faults.points):
            return None

        async def hit(index: int) -> None:
            await self.faults.hit(f"after_chunk_sent:{index}", transfer_id=transfer_id)

        return hit
