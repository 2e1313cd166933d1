"""The daemon's state and the handoff logic; the gRPC services are thin layers over it.

One :class:`Node` per process owns the pools, offers, sessions, transfers and peers, and
runs the three handoff paths:

* :meth:`Node.pull` on the decode side — local copy when the ticket names this daemon,
  otherwise a UCX pull from the offering daemon;
* :meth:`Node.serve_transfer` on the prefill side — answers a peer's pull over the
  ``PeerService.Transfer`` stream and sends the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np

from kvxfer_client._errors import (
    MAY_STILL_WRITE,
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    IncompatibleError,
    InvalidRequestError,
    KvxferError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
    error_from_rpc,
)
from kvxfer_client._layout import signature_mismatch
from kvxfer_client._proto import common_pb2, engine_pb2, peer_pb2
from kvxfer_client._ticket import Ticket
from kvxfer_client._version import PROTOCOL_VERSION, __version__

from ._config import Settings
from ._faults import Faults
from ._log import log_event
from ._metrics import Metrics, NodeState
from ._offers import Offer, OfferTable
from ._sessions import Session, check_owner
from ._transfers import TransferRecord, TransferTable
from .control.peers import Peer, PeerDirectory
from .dataplane.aligned import aligned_empty
from .dataplane.cma import self_copy_works
from .dataplane.gpucopy import BlockSide, GpuDevices
from .dataplane.hostcopy import copy_chunk
from .dataplane.plan import SidePlan, build_plan, num_chunks, stream_plan
from .dataplane.staging import StagingLease, StagingPool
from .dataplane.ucp_iov import CANCEL_CONFIRM_S
from .dataplane.ucx import UcxTransport, describe_transport
from .memory.pools import Pool, PoolRegistry, check_block_ids

__all__ = ["Node"]

T = TypeVar("T")
_PATH_NAMES = {common_pb2.TRANSFER_PATH_LOCAL: "local", common_pb2.TRANSFER_PATH_REMOTE: "remote"}
_RESULT_NAMES = {
    common_pb2.TRANSFER_STATE_SUCCEEDED: "succeeded",
    common_pb2.TRANSFER_STATE_CANCELLED: "cancelled",
}
_MEMORY_KINDS: dict[int, tuple[str, str]] = {
    common_pb2.MEMORY_KIND_HOST_SHM: ("host", "cpu"),
    common_pb2.MEMORY_KIND_CUDA_IPC: ("cuda", "gpu"),
}
_REASON_NAMES: dict[int, str] = {
    v: k.removeprefix("RELEASE_REASON_").lower() for k, v in common_pb2.ReleaseReason.items()
}
MIN_CHUNK = 64 << 10
MAX_CHUNK = 256 << 20
#: Local host handoffs up to this size are copied on the event loop (about 10 us at memory
#: speed); larger ones go to the copy threads.
INLINE_COPY_BYTES = 128 << 10
#: The offering side commits (releases the offer as pulled, says closed) only with at least
#: this much of the transfer stream's deadline left, so that closed reaches the puller before
#: the same deadline ends its wait (peer.proto, "Outcomes").
COMMIT_MARGIN_S = 1.0


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
        self.ucx = ucx
        self.pools = PoolRegistry()
        self.offers = OfferTable(settings.max_offers, self._expire)
        self.sessions: dict[str, Session] = {}
        self.transfers = TransferTable(settings.history)
        self.lease_expiries = 0
        self.executor = ThreadPoolExecutor(settings.copy_threads, thread_name_prefix="kvxfer-copy")
        self.single_pass = settings.local_single_pass and self_copy_works()
        if settings.local_single_pass and not self.single_pass:
            log_event(
                "local_copy.two_pass",
                logging.WARNING,
                reason="process_vm_readv on this process was refused (seccomp or kernel); "
                "local host copies go through scratch",
            )
        self.send_staging = StagingPool(settings.staging_bytes, settings.chunk_bytes)
        self.recv_staging = StagingPool(settings.staging_bytes, settings.chunk_bytes)
        self.peers: PeerDirectory | None = None
        self._gpu: GpuDevices | None = None  # made on first GPU use (see ``gpu``)
        self._tcp_warned: set[str] = set()
        self.metrics = Metrics(
            NodeState(
                offers=lambda: len(self.offers.offers),
                transfers=lambda: Counter(role for role, _ in list(self.transfers.active)),
                pool_bytes=self._pool_bytes,
                peers=lambda: Counter(p.state for p in list(self.peers.by_id.values())) if self.peers else Counter(),
                staging=self._staging_state,
                serving=lambda: not self.draining,
            )
        )
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def data_plane_ok(self) -> bool:
        """Whether remote transfers can run: UCX loaded and its worker progressing."""
        return self.ucx is not None and self.ucx.healthy

    def _staging_state(self) -> dict[str, tuple[int, int, int, int]]:
        """(buffers in use, buffers allocated, buffer limit, buffer bytes) per direction; GPU
        staging summed over GPUs."""

        def state_of(pools: list[StagingPool], size: int) -> tuple[int, int, int, int]:
            return (
                sum(p.in_use for p in pools),
                sum(p.allocated for p in pools),
                sum(p.capacity for p in pools),
                size,
            )

        state = {
            "send": state_of([self.send_staging], self.send_staging.buffer_bytes),
            "receive": state_of([self.recv_staging], self.recv_staging.buffer_bytes),
        }
        if self._gpu is not None:
            for direction in ("send", "receive"):
                pools = self._gpu.staging_pools(direction)
                if pools:
                    state["gpu_" + direction] = state_of(pools, self._gpu.buffer_bytes)
        return state

    def _pool_bytes(self) -> dict[tuple[str, str], int]:
        totals: dict[tuple[str, str], int] = {}
        for pool in list(self.pools.pools.values()):
            key = (_MEMORY_KINDS.get(pool.kind, ("unknown", ""))[0], pool.device_name)
            totals[key] = totals.get(key, 0) + pool.nbytes
        return totals

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
        self.peers = PeerDirectory(self.identity(), self.settings.peer_timeout_s, credentials)

    def _error_handling(self, peer: Peer) -> bool:
        """Whether endpoints to ``peer`` use UCX peer-failure handling (this side's setting)."""
        return _resolve_error_handling(self.settings.ucx_error_handling, peer.same_host)

    def _check_error_handling(self, peer: Peer) -> bool:
        """This side's error handling towards ``peer``, once both ends are known to agree: UCX
        fails an endpoint whose ends differ only when the first message arrives, and the
        transfer then waits for its deadline."""
        mine = self._error_handling(peer)
        theirs_setting = peer.identity.ucx_error_handling or "auto"
        if theirs_setting not in ("auto", "on", "off"):
            raise IncompatibleError(f"peer {peer.daemon_id} sent ucx_error_handling={theirs_setting[:16]!r}")
        if _resolve_error_handling(theirs_setting, peer.same_host) != mine:
            raise IncompatibleError(
                f"UCX error handling towards {peer.daemon_id} is {'on' if mine else 'off'} here and "
                f"{'off' if mine else 'on'} there (ucx_error_handling {self.settings.ucx_error_handling!r} here, "
                f"{theirs_setting!r} there): give both daemons the same ucx_error_handling"
            )
        return mine

    def _transport(self, peer: Peer, pool: Pool | None = None) -> str:
        assert self.ucx is not None
        gpu = pool is not None and pool.on_gpu
        transport = describe_transport(
            self.ucx.transports, list(peer.identity.ucx_transports), peer.same_host, self._error_handling(peer), gpu
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

    @property
    def gpu(self) -> GpuDevices:
        """Per-GPU copiers and staging, made when the first GPU pool moves bytes."""
        if self._gpu is None:
            self._gpu = GpuDevices(self.settings.gpu_staging_bytes, self.settings.gpu_chunk_bytes)
        return self._gpu

    # -- sessions, pools, offers -------------------------------------------------------------

    def open_session(self, engine_name: str) -> Session:
        if self.draining:
            raise UnavailableError("kvxferd is draining: no new engine sessions")
        session = Session(engine_name[:256])
        self.sessions[session.session_id] = session
        log_event("session.open", session=session.label, engine=session.engine_name)
        return session

    def close_session(self, session: Session) -> None:
        """The engine went away: drop its pools (and their offers) before its memory goes."""
        session.closed = True
        self.sessions.pop(session.session_id, None)
        session.close_fds()
        for pool_id in list(session.pools):
            self.deregister_pool(pool_id, common_pb2.RELEASE_REASON_POOL_GONE)
        log_event("session.close", session=session.label, engine=session.engine_name)

    def session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"no session {session_id!r}: open one with WatchEvents first")
        return session

    def register_pool(self, req: engine_pb2.RegisterPoolRequest) -> Pool:
        session = self.session(req.session_id)
        pool = self.pools.register(session, req.buffers, req.layout, req.name)
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

    def deregister_pool(
        self, pool_id: str, reason: common_pb2.ReleaseReason.ValueType = common_pb2.RELEASE_REASON_POOL_GONE
    ) -> int:
        pool = self.pools.get(pool_id)
        released = 0
        for offer_id in list(pool.offers):
            offer = self.offers.offers.get(offer_id)
            if offer is not None:
                self.release_offer(offer, reason, "pool deregistered")
                released += 1
        for record in list(self.transfers.active.values()):
            if pool_id in record.pools:
                self.abort(
                    record, f"pool {pool_id} of transfer {record.transfer_id} was deregistered on {self.daemon_id}"
                )
        self.pools.remove(pool_id)
        session = self.sessions.get(pool.session_id)
        if session is not None:
            session.pools.discard(pool_id)
        # Unmap only once no transfer touches the memory: cancelled transfers are still
        # unwinding here, and UCX or a copy thread writing into unmapped memory would crash us.
        pool.closing = True
        if pool.busy == 0:
            pool.close()
        log_event("pool.deregister", pool_id=pool_id, released_offers=released, busy=pool.busy)
        return released

    def _done_with(self, pool: Pool) -> None:
        pool.busy -= 1
        if pool.closing and pool.busy == 0:
            pool.close()

    def offer(self, req: engine_pb2.OfferRequest) -> tuple[Offer, Ticket]:
        if self.draining:
            raise UnavailableError("kvxferd is draining: no new offers")
        pool = self.owned_pool(req.pool_id, req.session_id)
        ids = check_block_ids(req.block_ids, pool.layout.num_blocks, "offer")
        lease = req.lease_s or self.settings.default_lease_s
        if not 0 < lease <= self.settings.max_lease_s:
            raise InvalidRequestError(f"lease_s must be in (0, {self.settings.max_lease_s}], got {req.lease_s}")
        offer = self.offers.create(pool, ids, lease)
        ticket = Ticket(
            daemon_id=self.daemon_id,
            peer_address=self.peer_address,
            offer_id=offer.offer_id,
            token=offer.token,
            num_blocks=len(ids),
            fingerprint=pool.fingerprint,
            total_bytes=offer.nbytes,
        )
        log_event("offer.create", offer_id=offer.offer_id, pool_id=pool.pool_id, blocks=len(ids), lease_s=lease)
        return offer, ticket

    def release_offer(
        self, offer: Offer, reason: common_pb2.ReleaseReason.ValueType, detail: str = "", transfer_id: str = ""
    ) -> None:
        if self.offers.remove(offer.offer_id) is None:
            return
        session = self.sessions.get(offer.pool.session_id)
        if session is not None:
            session.emit(
                engine_pb2.EngineEvent(
                    offer_released=engine_pb2.OfferReleased(
                        offer_id=offer.offer_id,
                        pool_id=offer.pool.pool_id,
                        reason=reason,
                        detail=detail,
                        transfer_id=transfer_id,
                    )
                )
            )
        self.metrics.offer_released(_REASON_NAMES.get(reason, "unknown"))
        log_event(
            "offer.release",
            offer_id=offer.offer_id,
            reason=_REASON_NAMES.get(reason, "?"),
            transfer_id=transfer_id or "-",
            detail=detail or "-",
        )

    def _expire(self, offer: Offer) -> None:
        self.lease_expiries += 1
        self.release_offer(offer, common_pb2.RELEASE_REASON_EXPIRED, "lease ended before any pull")

    def withdraw(self, offer_id: str, session_id: str) -> None:
        offer = self.offers.offers.get(offer_id)
        if offer is None:
            raise NotFoundError(f"no offer {offer_id!r}")
        check_owner(offer.pool.session_id, session_id, f"offer {offer_id!r}")
        if offer.state != "offered":
            raise IncompatibleError(f"offer {offer_id!r} is being pulled; cancel the transfer instead")
        self.release_offer(offer, common_pb2.RELEASE_REASON_CANCELLED, "withdrawn by the engine")

    def shutdown(self) -> None:
        """Release every offer and drop every pool (the daemon is exiting)."""
        for offer in list(self.offers.offers.values()):
            self.release_offer(offer, common_pb2.RELEASE_REASON_SHUTDOWN, "daemon shutting down")
        for pool_id in list(self.pools.pools):
            self.deregister_pool(pool_id, common_pb2.RELEASE_REASON_SHUTDOWN)

    # -- transfers: bookkeeping --------------------------------------------------------------

    def _begin(self, record: TransferRecord) -> TransferRecord:
        self.transfers.start(record)
        record.task = asyncio.current_task()
        self._idle.clear()
        return record

    def _end(self, record: TransferRecord, state: common_pb2.TransferState.ValueType, detail: str = "") -> None:
        self.transfers.finish(record, state, detail)
        self.metrics.transfer_finished(
            _PATH_NAMES.get(record.path, "unknown"),
            record.transport,
            _RESULT_NAMES.get(state, "failed"),
            record.nbytes,
            record.duration_s,
        )
        if not self.transfers.active:
            self._idle.set()
        fields: dict[str, Any] = {
            "transfer_id": record.transfer_id,
            "role": record.role,
            "offer_id": record.offer_id,
            "transport": record.transport or "-",
            "bytes": record.nbytes,
            "duration_s": round(record.duration_s, 6),
        }
        if record.phases:
            fields["phases_ms"] = ",".join(f"{name}={t * 1e3:.2f}" for name, t in record.phases)
        if state == common_pb2.TRANSFER_STATE_SUCCEEDED:
            log_event("transfer.done", **fields)
        else:
            log_event("transfer.failed", detail=detail, **fields)

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def cancel_transfer(self, transfer_id: str, session_id: str | None = None) -> tuple[bool, bool]:
        """Cancel every running transfer with this id (our pull, or a peer's pull of our
        offer: the peer then sees its pull fail). Returns ``(cancelled, may_still_write)``
        once the transfers have unwound, or after ``peer_timeout_s`` if they have not.
        ``session_id``: an engine may cancel only transfers touching its own pools (None: an
        operator, through AdminService)."""
        if not 1 <= len(transfer_id) <= 128:
            raise InvalidRequestError("transfer_id must be 1..128 characters")
        # A transfer whose bytes the receiver already confirmed is finishing, not cancellable:
        # the pull succeeds and the offer is released as pulled.
        records = [r for r in self.transfers.find(transfer_id) if not r.committed]
        if session_id is not None and records:
            owners = {self.pools.pools[p].session_id for r in records for p in r.pools if p in self.pools.pools}
            if session_id not in owners:
                raise PermissionDeniedError(f"transfer {transfer_id!r} touches no pool of this engine session")
        tasks = [r.task for r in records if r.task is not None and not r.task.done()]
        unconfirmed = self._unconfirmed_receives()
        for r in records:
            self.abort(r, f"transfer {transfer_id} was cancelled on daemon {self.daemon_id}")
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.peer_timeout_s)
        still_running = any(not t.done() for t in tasks)
        return bool(records), still_running or self._unconfirmed_receives() > unconfirmed

    def abort(self, record: TransferRecord, detail: str) -> None:
        """Cancel a running transfer from this side; the peer is told ``detail`` (a cancelled
        stream handler alone would leave it waiting for its deadline). A committed transfer
        (every byte confirmed) is left to finish."""
        if record.committed:
            return
        record.abort_detail = record.abort_detail or detail
        if record.task is not None and not record.task.done():
            record.task.cancel()

    def _unconfirmed_receives(self) -> int:
        return self.ucx.iov.unconfirmed if self.ucx is not None and self.ucx.iov is not None else 0

    async def extend_lease(self, msg: common_pb2.Ticket, lease_s: float) -> float:
        """Extend an offer's lease on the daemon that made it; returns seconds left."""
        ticket = _checked_ticket(msg)
        if not 0 < lease_s <= self.settings.max_lease_s:
            raise InvalidRequestError(f"lease_s must be in (0, {self.settings.max_lease_s}]")
        if ticket.daemon_id == self.daemon_id:
            return self.offers.extend(ticket.offer_id, ticket.token, lease_s)
        if self.peers is None:
            raise UnavailableError("daemon is starting")
        peer = await self._dial_offerer(ticket)
        if peer.daemon_id != ticket.daemon_id:
            raise NotFoundError(f"daemon {ticket.daemon_id!r} is gone from {ticket.peer_address}: its offers with it")
        assert peer.stub is not None
        req = peer_pb2.PeerExtendLeaseRequest(offer_id=ticket.offer_id, token=ticket.token, lease_s=lease_s)
        try:
            resp = await peer.stub.ExtendLease(req, timeout=self.settings.peer_timeout_s)
        except grpc.RpcError as exc:
            err = _peer_error(exc, ticket.peer_address)
            if isinstance(err, UnavailableError):
                self._drop_peer(peer)
            raise err from None
        return float(resp.lease_remaining_s)

    # -- decode side -------------------------------------------------------------------------

    async def pull(self, req: engine_pb2.PullRequest) -> engine_pb2.PullResponse:
        if self.draining:
            raise UnavailableError("kvxferd is draining: no new pulls")
        ticket = _checked_ticket(req.ticket)
        pool = self.owned_pool(req.pool_id, req.session_id)
        ids = check_block_ids(req.block_ids, pool.layout.num_blocks, "pull destination")
        if len(ids) != ticket.num_blocks:
            raise InvalidRequestError(f"ticket holds {ticket.num_blocks} blocks, {len(ids)} destination ids given")
        if ticket.fingerprint != pool.fingerprint:
            raise IncompatibleError(
                f"layout fingerprint mismatch: offer {ticket.fingerprint}, destination pool {pool.fingerprint}"
            )
        # Same fingerprint, same bytes per block: a ticket's byte count is derived, never trusted.
        if ticket.total_bytes != ticket.num_blocks * pool.layout.bytes_per_block:
            raise InvalidRequestError(
                f"malformed ticket: total_bytes {ticket.total_bytes} is not {ticket.num_blocks} blocks of "
                f"{pool.layout.bytes_per_block} bytes"
            )
        timeout = req.timeout_s or self.settings.pull_timeout_s
        if not 0 < timeout <= 3600:
            raise InvalidRequestError("timeout_s must be in (0, 3600]")
        transfer_id = req.transfer_id or "xfer-" + secrets.token_hex(8)
        if len(transfer_id) > 128:
            raise InvalidRequestError("transfer_id longer than 128 characters")
        dst_key = _destination_key(pool.pool_id, ids)
        if req.transfer_id:
            done = self.transfers.succeeded_pull(transfer_id)
            if done is not None:
                # A retry of a pull that already landed (its answer was lost): answer again,
                # move nothing. A different destination under the same id is a client bug.
                if done.dst_key != dst_key or done.offer_id != ticket.offer_id:
                    raise AlreadyExistsError(f"transfer {transfer_id!r} already moved another offer or destination")
                return _pull_response(done)
        local = ticket.daemon_id == self.daemon_id
        record = TransferRecord(
            transfer_id,
            "decode",
            common_pb2.TRANSFER_PATH_LOCAL if local else common_pb2.TRANSFER_PATH_REMOTE,
            ticket.offer_id,
            peer_daemon_id="" if local else ticket.daemon_id,
            nbytes=ticket.total_bytes,
            pools=(pool.pool_id,),
            dst_key=dst_key,
        )
        self._begin(record)
        pool.busy += 1
        try:
            # Only this deadline raises TimeoutError here: every step's own deadline raises
            # DeadlineExceededError naming that step (see ``_within``).
            async with asyncio.timeout(timeout) as deadline:
                if local:
                    await self._pull_local(record, ticket, pool, ids)
                else:
                    await self._pull_remote(record, ticket, pool, ids, timeout, deadline)
        except KvxferError as exc:  # before TimeoutError: DeadlineExceededError is one
            self._end(record, common_pb2.TRANSFER_STATE_FAILED, str(exc))
            if record.may_still_write:
                raise type(exc)(str(exc) + _quarantine(record)) from None
            raise
        except TimeoutError:
            self._end(record, common_pb2.TRANSFER_STATE_FAILED, f"deadline of {timeout}s exceeded")
            msg = f"pull {transfer_id} did not finish within {timeout}s"
            raise DeadlineExceededError(msg + _quarantine(record)) from None
        except asyncio.CancelledError:
            self._end(record, common_pb2.TRANSFER_STATE_CANCELLED, "cancelled")
            raise CancelledError(f"pull {transfer_id} was cancelled" + _quarantine(record)) from None
        except Exception as exc:
            self._end(record, common_pb2.TRANSFER_STATE_FAILED, repr(exc))
            raise
        finally:
            self._done_with(pool)
        self._end(record, common_pb2.TRANSFER_STATE_SUCCEEDED)
        return _pull_response(record)

    async def _pull_local(
        self, record: TransferRecord, ticket: Ticket, dst: Pool, dst_ids: np.ndarray[Any, Any]
    ) -> None:
        offer = self.offers.claim(ticket.offer_id, ticket.token)
        record.transport = "local-copy"
        try:
            src = offer.pool
            mismatch = signature_mismatch(src.layout.signature(), dst.layout.signature())
            if mismatch:
                self.offers.unclaim(offer)
                raise IncompatibleError(f"incompatible layouts: {mismatch}")
            if src.on_gpu or dst.on_gpu:
                src.busy += 1
                started = time.perf_counter()
                try:
                    record.transport, record.device_s = await self._copy_local_gpu(src, offer.block_ids, dst, dst_ids)
                finally:
                    self._done_with(src)
                record.data_plane_s = time.perf_counter() - started
                record.nbytes = int(ticket.total_bytes)
                self.release_offer(offer, common_pb2.RELEASE_REASON_PULLED, "", record.transfer_id)
                return
            chunk = self.settings.local_chunk_bytes
            src_plan = build_plan(src.regions, offer.block_ids, chunk)
            dst_plan = build_plan(dst.regions, dst_ids, chunk)
            record.nbytes = src_plan.total_bytes
            src.busy += 1
            started = time.perf_counter()
            try:
                await self._copy_local_host(src, src_plan, dst, dst_plan)
            finally:
                self._done_with(src)
            record.data_plane_s = time.perf_counter() - started
        except BaseException as exc:
            if offer.state == "pulling":
                self.release_offer(
                    offer, common_pb2.RELEASE_REASON_FAILED, f"local pull failed: {exc!r}", record.transfer_id
                )
            raise
        self.release_offer(offer, common_pb2.RELEASE_REASON_PULLED, "", record.transfer_id)

    async def _copy_local_host(self, src: Pool, src_plan: SidePlan, dst: Pool, dst_plan: SidePlan) -> None:
        """Copy a local host handoff: inline when small, else its chunks dealt round-robin to
        the copy threads (a lone handoff uses them all)."""
        if src_plan.total_bytes <= INLINE_COPY_BYTES:
            # Microseconds of copying: the hop to a copy thread and back would cost more.
            _copy_plan(src.arrays, src_plan, dst.arrays, dst_plan, self.single_pass)
            return
        stop = threading.Event()
        parts = min(self.settings.copy_threads, len(src_plan.chunks))
        loop = asyncio.get_running_loop()
        copying = [
            loop.run_in_executor(
                self.executor, _copy_plan, src.arrays, src_plan, dst.arrays, dst_plan, self.single_pass, stop, k, parts
            )
            for k in range(parts)
        ]
        try:
            await asyncio.shield(asyncio.gather(*copying))
        except BaseException:
            # Every copy thread stops at its next chunk; wait for them all, so that nobody
            # hears "failed" or "cancelled" (and reuses the destination) while one can still
            # write there.
            stop.set()
            await asyncio.wait(copying)
            raise

    async def _copy_local_gpu(
        self, src: Pool, src_ids: np.ndarray[Any, Any], dst: Pool, dst_ids: np.ndarray[Any, Any]
    ) -> tuple[str, float]:
        """One kernel launch over every segment (a host side is pinned and read over PCIe);
        returns the transport and the copy's GPU time."""
        device = dst.device if dst.device is not None else src.device
        assert device is not None
        for pool in (src, dst):
            pool.pin_for_gpu()
        src_dev = src.device if src.device is not None else device
        return await self.gpu.copy_local(
            BlockSide.of(src_dev, src.base, src.regions, src_ids),
            BlockSide.of(device, dst.base, dst.regions, dst_ids),
        )

    async def _pull_remote(
        self,
        record: TransferRecord,
        ticket: Ticket,
        dst: Pool,
        dst_ids: np.ndarray[Any, Any],
        timeout: float,
        deadline: asyncio.Timeout,
    ) -> None:
        if self.ucx is None or self.peers is None:
            raise UnavailableError("the UCX data plane is not available (install kvxfer[ucx] or a cu12/cu13 extra)")
        peer = await self._dial_offerer(ticket)
        if peer.daemon_id != ticket.daemon_id:
            raise IncompatibleError(
                f"the daemon at {ticket.peer_address} is {peer.daemon_id!r}, the ticket names {ticket.daemon_id!r}"
            )
        record.transport = self._transport(peer, dst)
        # The most this side can take per chunk; the sender picks the size (TransferAccepted).
        max_chunk = self.settings.gpu_chunk_bytes if dst.on_gpu else self.settings.chunk_bytes
        side = BlockSide.of(dst.device, dst.base, dst.regions, dst_ids) if dst.device is not None else None
        assert peer.stub is not None
        async with contextlib.AsyncExitStack() as stack:
            ep = await self._endpoint(peer)
            tag_base = secrets.randbits(40) << 24
            # The stream's deadline (which the offerer sees too) bounds the wait for closed.
            stream_deadline_s = timeout + self.settings.peer_timeout_s
            call = peer.stub.Transfer(timeout=stream_deadline_s)
            receiving: asyncio.Task[None] | None = None
            sent: asyncio.Task[Any] | None = None
            lease: StagingLease | None = None
            try:
                await call.write(
                    peer_pb2.TransferClientMessage(
                        start=peer_pb2.TransferStart(
                            transfer_id=record.transfer_id,
                            offer_id=ticket.offer_id,
                            token=ticket.token,
                            receiver_daemon_id=self.daemon_id,
                            receiver_signature=dst.layout.signature(),
                            num_blocks=len(dst_ids),
                            tag_base=tag_base,
                            chunk_bytes=max_chunk,
                            timeout_s=timeout,
                        )
                    )
                )
                record.mark("start_sent")
                # Planned while the offerer claims and plans its side (the sender nearly
                # always takes the offered chunk size).
                expected = self._receive_plan(dst, side, dst_ids, max_chunk)
                accepted = await _read(call, "accepted", self.settings.peer_timeout_s)
                record.mark("accepted")
                chunk = accepted.accepted.chunk_bytes or max_chunk
                if not MIN_CHUNK <= chunk <= max_chunk:
                    raise IncompatibleError(f"peer chose {chunk}-byte chunks; this side takes {MIN_CHUNK}..{max_chunk}")
                plan = expected if chunk == max_chunk else self._receive_plan(dst, side, dst_ids, chunk)
                if accepted.accepted.total_bytes != plan.total_bytes:
                    raise IncompatibleError(
                        f"peer sends {accepted.accepted.total_bytes} bytes, destination expects {plan.total_bytes}"
                    )
                staging, need = self._staging_for(dst, plan, "receive")
                lease = await stack.enter_async_context(staging.lease(need))
                record.mark("staging")
                started = time.perf_counter()
                if side is not None:
                    copier = self.gpu.copier(side.device)
                    uploaded = copier.upload_side(side)
                    receive = self.ucx.receive_gpu(
                        ep, plan, uploaded, copier, tag_base, lease, self.settings.window, mark=record.mark
                    )
                else:
                    receive = self.ucx.receive(
                        ep,
                        plan,
                        dst.arrays,
                        tag_base,
                        lease,
                        self.executor,
                        self.settings.window,
                        on_unconfirmed=lambda: setattr(record, "may_still_write", True),
                    )
                receiving = asyncio.create_task(receive)
                sent = asyncio.create_task(_read(call, "sent", None))
                first, _ = await asyncio.wait({receiving, sent}, return_when=asyncio.FIRST_COMPLETED)
                if sent in first:
                    sent.result()  # the offerer failed (or aborted) while bytes were due: end now
                await receiving
                record.data_plane_s = time.perf_counter() - started
                record.mark("received")
                # Every receive has completed, so every byte has landed (the tags are this
                # transfer's own): say done now, while the offerer's "sent" is on its way.
                await self.faults.hit("before_done", transfer_id=record.transfer_id)
                record.committed = True  # the sender releases the offer as pulled on this message
                try:
                    await call.write(peer_pb2.TransferClientMessage(done=peer_pb2.TransferDone(ok=True)))
                except asyncio.InvalidStateError:
                    # The offerer already ended the stream (a cancel or failure on its side):
                    # reading it raises its status, which says why.
                    await _read(call, "closed", self.settings.peer_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.INTERNAL:
                        raise
                    # gRPC core refused the write as the offerer's status arrived; its reason
                    # is lost with it. The pull fails on both sides all the same.
                    raise UnavailableError(
                        f"peer {ticket.peer_address} ended the transfer before it read done ({exc.details()})"
                    ) from None
                # From here the offerer decides (peer.proto, "Outcomes"): closed is success, an
                # error status is failure. Neither the pull's own deadline nor a step deadline
                # may decide instead, or a late closed would fail this side only; the stream's
                # deadline, which the offerer also keeps, bounds the wait.
                deadline.reschedule(None)
                await self.faults.hit("before_closed_read", transfer_id=record.transfer_id)
                await sent
                await _read(call, "closed", None)
                record.mark("closed")
                await call.done_writing()
            except BaseException as exc:
                if sent is not None and not sent.done():
                    sent.cancel()
                if receiving is not None and not receiving.done():
                    # Receives may still be posted into the destination: cancel them (and
                    # abort the endpoint) and wait for UCX to confirm before the engine hears
                    # of the failure and reuses those blocks.
                    receiving.cancel()
                    await asyncio.wait({receiving}, timeout=CANCEL_CONFIRM_S + 1.0)
                    if not receiving.done():
                        record.may_still_write = True  # not even the cancellation finished
                    if self.ucx.iov is None:
                        self.ucx.forget(peer.daemon_id)  # UCXX receives cancel only with it
                    elif record.may_still_write:
                        # UCX would not cancel a matched receive: closing the endpoint makes it
                        # give the receive up (the next pull says Hello again).
                        self._drop_peer(peer)
                    if lease is not None:
                        lease.poisoned = True
                call.cancel()
                err = _peer_error(exc, ticket.peer_address) if isinstance(exc, grpc.RpcError) else exc
                if record.committed and isinstance(err, DeadlineExceededError):
                    err = DeadlineExceededError(
                        f"pull {record.transfer_id}: every byte landed, but {ticket.peer_address} did not close "
                        f"the transfer within the stream's deadline of {stream_deadline_s}s: both sides fail it"
                    )
                if isinstance(err, UnavailableError):
                    self._drop_peer(peer)  # the next pull says Hello again and makes a new endpoint
                if err is exc:
                    raise
                raise err from None

    def _staging_for(self, pool: Pool, plan: SidePlan | None, direction: str) -> tuple[StagingPool, int]:
        """The staging a remote transfer of ``plan`` takes on ``pool``'s side ("send" or
        "receive"), and how many buffers: GPU pools stage every chunk; host pools stage only
        fragmented chunks, and none at all when UCX gathers sends from (scatters receives
        into) the pool (then ``plan`` may still be None)."""
        window = self.settings.window
        assert self.ucx is not None
        uses_iov = self.ucx.gather_send if direction == "send" else self.ucx.scatter_receive
        host_staging = self.send_staging if direction == "send" else self.recv_staging
        if pool.device is None and uses_iov:
            return host_staging, 0
        if plan is None:
            raise ValueError("a transfer that stages needs its plan first")
        if pool.device is not None:
            return self.gpu.staging(pool.device, direction), min(window, len(plan.chunks))
        return host_staging, min(window, _staged_chunks(plan))

    @staticmethod
    def _receive_plan(dst: Pool, side: BlockSide | None, dst_ids: np.ndarray[Any, Any], chunk: int) -> SidePlan:
        """The destination's chunks: computed on the GPU for GPU pools, planned runs for host."""
        if side is not None:
            return stream_plan(side.total_bytes, chunk)
        return build_plan(dst.regions, dst_ids, chunk)

    async def _dial_offerer(self, ticket: Ticket) -> Peer:
        """The peer at the ticket's address. When it is not the daemon the ticket names, another
        daemon may have restarted on that address since our Hello: say Hello again (once)."""
        assert self.peers is not None
        if self.ucx is not None:
            self.ucx.address_probe.start()  # again, if its child died since
        peer = await self.peers.dial(ticket.peer_address)
        if peer.daemon_id != ticket.daemon_id:
            self._drop_peer(peer)
            peer = await self.peers.dial(ticket.peer_address)
        return peer

    def _chunk_fault(self, transfer_id: str) -> Callable[[int], Awaitable[None]] | None:
        """The ``after_chunk_sent:N`` fault points as a send hook (None when none is armed)."""
        if not any(p.startswith("after_chunk_sent:") for p in self.faults.points):
            return None

        async def hit(index: int) -> None:
            await self.faults.hit(f"after_chunk_sent:{index}", transfer_id=transfer_id)

        return hit

    async def _endpoint(self, peer: Peer) -> Any:
        """The UCX endpoint to ``peer`` (made from its worker address on first use)."""
        assert self.ucx is not None
        await self.faults.hit("peer_endpoint", peer=peer.daemon_id)
        ep = self.ucx.open_endpoint(peer.daemon_id)
        if ep is not None:
            return ep  # its address was probed when it was made
        address, error_handling = peer.identity.ucx_worker_address, self._check_error_handling(peer)
        # Bounded by the probe's own deadline: its first use may wait for the child to start.
        await self.ucx.address_probe.check(address, error_handling, peer.daemon_id)
        return await _within(
            self.ucx.endpoint(peer.daemon_id, address, error_handling),
            self.settings.peer_timeout_s,
            f"the UCX endpoint to {peer.daemon_id}",
        )

    def _drop_peer(self, peer: Peer) -> None:
        assert self.peers is not None and self.ucx is not None
        self.peers.mark_failed(peer)
        self.ucx.forget(peer.daemon_id)

    # -- prefill side ------------------------------------------------------------------------

    async def serve_transfer(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Answer one ``PeerService.Transfer`` stream (see peer.proto for the sequence)."""
        first = await _within(context.read(), self.settings.peer_timeout_s, "the puller's 'start'")
        if first is grpc.aio.EOF or first.WhichOneof("msg") != "start":
            raise InvalidRequestError("a Transfer stream must begin with start")
        start = first.start
        if self.ucx is None or self.peers is None:
            raise UnavailableError("the UCX data plane is not available on this daemon")
        peer = self.peers.known(start.receiver_daemon_id)
        if not MIN_CHUNK <= start.chunk_bytes <= MAX_CHUNK:
            raise InvalidRequestError(f"chunk_bytes must be in {MIN_CHUNK}..{MAX_CHUNK}")
        if not start.transfer_id or len(start.transfer_id) > 128:
            raise InvalidRequestError("transfer_id must be 1..128 characters")
        # Headers go out now, before this transfer can be aborted (``abort`` cancels this
        # task): a cancel landing inside the first write would leave gRPC believing they were
        # never sent, and the abort status that follows (which would resend them) is then
        # rejected, leaving the puller waiting for its deadline.
        await context.send_initial_metadata(())
        offer = self.offers.claim(start.offer_id, bytes(start.token))
        if context.done():
            # The puller gave up (its deadline) before this side claimed: nothing moved, so
            # the offer stays pullable instead of being released as failed.
            self.offers.unclaim(offer)
            raise DeadlineExceededError("the puller left before the offer was claimed")
        record = TransferRecord(
            start.transfer_id,
            "prefill",
            common_pb2.TRANSFER_PATH_REMOTE,
            offer.offer_id,
            peer_daemon_id=peer.daemon_id,
            nbytes=offer.nbytes,
            transport=self._transport(peer, offer.pool),
            pools=(offer.pool.pool_id,),
        )
        try:
            mismatch = signature_mismatch(offer.pool.layout.signature(), start.receiver_signature)
            if mismatch:
                raise IncompatibleError(f"incompatible layouts: {mismatch}")
            if start.num_blocks != len(offer.block_ids):
                raise InvalidRequestError(
                    f"offer holds {len(offer.block_ids)} blocks, pull asks for {start.num_blocks}"
                )
            self._begin(record)
        except BaseException:
            self.offers.unclaim(offer)
            raise
        pool = offer.pool
        pool.busy += 1
        released = False
        # gRPC cancels this handler when the puller hangs up; this makes sure of it whatever
        # step the handler is in, so the offer is released at once rather than at our deadline.
        handler = asyncio.current_task()
        serving = True

        def _puller_gone(_: object) -> None:
            if serving and handler is not None:
                handler.cancel()

        context.add_done_callback(_puller_gone)
        try:
            timeout = min(start.timeout_s or self.settings.pull_timeout_s, 3600.0)
            async with asyncio.timeout(timeout + self.settings.peer_timeout_s):
                # The receiver's maximum, capped by what this side stages per chunk.
                own = self.settings.gpu_chunk_bytes if pool.on_gpu else self.settings.chunk_bytes
                chunk = min(start.chunk_bytes, own)
                plan: SidePlan | None = None
                if pool.on_gpu:
                    assert pool.device is not None
                    side = BlockSide.of(pool.device, pool.base, pool.regions, offer.block_ids)
                    plan = stream_plan(side.total_bytes, chunk)
                elif not self.ucx.gather_send:
                    plan = build_plan(pool.regions, offer.block_ids, chunk)  # staging depends on it
                ep = await self._endpoint(peer)
                try:
                    await self.faults.hit("endpoint_broken", transfer_id=record.transfer_id, peer=peer.daemon_id)
                except UnavailableError:
                    self.ucx.break_endpoint(ep)  # the send below fails, and so would every later one
                staging, need = self._staging_for(pool, plan, "send")
                async with staging.lease(need) as lease:
                    record.mark("staging")
                    await context.write(
                        peer_pb2.TransferServerMessage(
                            accepted=peer_pb2.TransferAccepted(
                                total_bytes=offer.nbytes,
                                num_chunks=num_chunks(offer.nbytes, chunk),
                                chunk_bytes=chunk,
                            )
                        )
                    )
                    await self.faults.hit("after_accepted", transfer_id=record.transfer_id)
                    if plan is None:
                        # UCX gathers from the pool: planned while the receiver posts receives.
                        plan = build_plan(pool.regions, offer.block_ids, chunk)
                    record.mark("planned")
                    if pool.on_gpu:
                        assert pool.device is not None
                        copier = self.gpu.copier(pool.device)
                        await self.ucx.send_gpu(
                            ep,
                            plan,
                            copier.upload_side(side),
                            copier,
                            start.tag_base,
                            lease,
                            self.settings.window,
                            mark=record.mark,
                        )
                    else:
                        await self.ucx.send(
                            ep,
                            plan,
                            pool.arrays,
                            start.tag_base,
                            lease,
                            self.settings.window,
                            after_chunk=self._chunk_fault(record.transfer_id),
                        )
                record.mark("sent")
                await context.write(
                    peer_pb2.TransferServerMessage(
                        sent=peer_pb2.TransferSent(bytes=plan.total_bytes, transport=record.transport)
                    )
                )
                done = await context.read()
                record.mark("confirmed")
                await self.faults.hit("after_done_read", transfer_id=record.transfer_id)
                if done is grpc.aio.EOF or done.WhichOneof("msg") != "done":
                    raise UnavailableError("receiver closed the transfer without confirming")
                if not done.done.ok:
                    raise UnavailableError(f"receiver reported failure: {done.done.detail}")
                left = context.time_remaining()
                if left is not None and left < COMMIT_MARGIN_S:
                    # The puller gives up at this same deadline: closed might not reach it in
                    # time, so both sides fail rather than risk a success on this side only.
                    raise DeadlineExceededError(
                        f"transfer {record.transfer_id}: done came with {max(left, 0.0):.2f}s of the stream's "
                        f"deadline left (under {COMMIT_MARGIN_S}s): too late to commit"
                    )
                record.committed = True
                self.release_offer(offer, common_pb2.RELEASE_REASON_PULLED, "", record.transfer_id)
                released = True
                await context.write(peer_pb2.TransferServerMessage(closed=peer_pb2.TransferClosed(released=True)))
        except BaseException as exc:
            # This handler's own deadline (a step's deadline is a DeadlineExceededError already).
            own_deadline = isinstance(exc, TimeoutError) and not isinstance(exc, KvxferError)
            if released:
                # The receiver confirmed every byte; only the closing message was interrupted.
                self._end(record, common_pb2.TRANSFER_STATE_SUCCEEDED)
            else:
                detail = "deadline exceeded" if own_deadline else str(exc) or repr(exc)
                self.release_offer(offer, common_pb2.RELEASE_REASON_FAILED, detail, record.transfer_id)
                self._end(record, common_pb2.TRANSFER_STATE_FAILED, detail)
            if own_deadline:
                raise DeadlineExceededError(f"transfer {record.transfer_id} exceeded its deadline") from None
            if isinstance(exc, asyncio.CancelledError) and record.abort_detail:
                # Cancelled here (an engine or operator aborted it), not by the peer hanging
                # up: end the stream with a status, or the puller would wait for its deadline.
                raise CancelledError(record.abort_detail) from None
            raise
        finally:
            serving = False
            self._done_with(pool)
        self._end(record, common_pb2.TRANSFER_STATE_SUCCEEDED)


_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}$")


def _resolve_error_handling(setting: str, same_host: bool) -> bool:
    return setting == "on" or (setting == "auto" and not same_host)


def _checked_ticket(msg: common_pb2.Ticket) -> Ticket:
    """A ticket from a request, refused (INVALID_ARGUMENT) unless it is well formed."""
    ticket = Ticket.from_proto(msg)
    if not ticket.offer_id or len(ticket.offer_id) > 128 or len(ticket.token) != 16:
        raise InvalidRequestError("malformed ticket (offer id or 16-byte token missing)")
    if not ticket.daemon_id or len(ticket.daemon_id) > 256:
        raise InvalidRequestError("malformed ticket (daemon id missing)")
    if not _ADDRESS.match(ticket.peer_address) or not 0 < int(ticket.peer_address.rsplit(":", 1)[1]) < 65536:
        raise InvalidRequestError(f"malformed ticket: peer address {ticket.peer_address[:100]!r} is not host:port")
    return ticket


def _quarantine(record: TransferRecord) -> str:
    """The marker the SDK turns into ``KvxferError.may_still_write``."""
    return MAY_STILL_WRITE if record.may_still_write else ""


def _pull_response(record: TransferRecord) -> engine_pb2.PullResponse:
    return engine_pb2.PullResponse(
        transfer_id=record.transfer_id,
        bytes=record.nbytes,
        path=record.path,
        transport=record.transport,
        duration_s=record.duration_s,
        data_plane_s=record.data_plane_s,
        device_s=record.device_s,
    )


def _destination_key(pool_id: str, ids: np.ndarray[Any, Any]) -> str:
    """Identifies a pull's destination (pool and block ids) for idempotent retries."""
    return (
        pool_id + ":" + hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=16).hexdigest()
    )


async def _within(aw: Awaitable[T], timeout: float | None, what: str = "a step of the transfer") -> T:
    """``await aw`` with a deadline; past it, DeadlineExceededError naming ``what`` and the
    deadline. Unlike ``asyncio.wait_for`` on Python 3.11, this never swallows a cancellation
    that arrives as ``aw`` completes (an outer pull deadline would be lost)."""
    try:
        async with asyncio.timeout(timeout):
            return await aw
    except TimeoutError:
        raise DeadlineExceededError(f"{what} did not happen within its deadline of {timeout}s") from None


def _copy_plan(
    src_arrays: Sequence[Any],
    src: SidePlan,
    dst_arrays: Sequence[Any],
    dst: SidePlan,
    single_pass: bool,
    stop: threading.Event | None = None,
    part: int = 0,
    parts: int = 1,
) -> None:
    """Copy chunks ``part``, ``part + parts``, ... of the plan (one copy thread's share),
    until ``stop`` is set."""
    scratch = None if single_pass else _scratch(src.chunk_bytes)
    for a, b in zip(src.chunks[part::parts], dst.chunks[part::parts], strict=True):
        if stop is not None and stop.is_set():
            return
        copy_chunk(src_arrays, a, dst_arrays, b, scratch, single_pass)


_SCRATCH: dict[tuple[int, int], Any] = {}


def _scratch(nbytes: int) -> Any:
    """One reusable scratch buffer per copy thread (runs inside the executor)."""
    key = (threading.get_ident(), nbytes)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = aligned_empty(nbytes)
        buf.fill(0)
    return buf


def _staged_chunks(plan: SidePlan) -> int:
    return sum(1 for c in plan.chunks if c.contiguous is None)


async def _read(call: Any, expected: str, timeout: float | None) -> Any:
    msg = await _within(call.read(), timeout, f"the peer's {expected!r}")
    if msg is grpc.aio.EOF:
        raise UnavailableError(f"peer closed the transfer before {expected}")
    if msg.WhichOneof("msg") != expected:
        raise UnavailableError(f"peer sent {msg.WhichOneof('msg')} where {expected} was due")
    return msg


def _peer_error(exc: grpc.RpcError, address: str) -> KvxferError:
    err = error_from_rpc(exc)
    return type(err)(f"peer {address}: {err}")
