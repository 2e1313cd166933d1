"""Transfer records: what is moving now, and a ring of what moved recently.

A handoff path calls :meth:`TransferTable.begin` in the task that moves the bytes and
:meth:`TransferTable.end` once it is over (metrics and the ``transfer.done``/``failed`` log
line happen there); :meth:`TransferTable.abort` cancels one from this side, and
:meth:`TransferTable.wait_idle` is what a draining daemon waits on.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvxfer.errors import (
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    IncompatibleError,
    InvalidRequestError,
    NotFoundError,
    OfferExpiredError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from kvxfer.proto import admin_pb2, common_pb2

from ._log import log_event

__all__ = ["EndedTransfer", "TransferRecord", "TransferTable", "described"]


@dataclass(frozen=True)
class EndedTransfer:
    """What the metrics hear of an ended transfer (bounded label values, its size and time)."""

    role: str
    path: str
    transport: str
    #: succeeded, failed, refused or cancelled.
    result: str
    #: Why it failed (see :func:`failure_reason`); "none" unless it did.
    reason: str
    nbytes: int
    seconds: float


#: Told of each ended transfer (the metrics).
Observer = Callable[[EndedTransfer], None]
_REFUSALS = (PermissionDeniedError, NotFoundError, InvalidRequestError, IncompatibleError, AlreadyExistsError)


def described(error: BaseException) -> str:
    """An error as an operator reads it (a release reason, a transfer's detail): its message,
    or what its kind means where it has none.

    >>> described(asyncio.CancelledError()), described(TimeoutError()), described(ValueError("bad size"))
    ('cancelled', 'deadline exceeded', 'bad size')
    """
    if isinstance(error, CancelledError | asyncio.CancelledError):
        return str(error) or "cancelled"
    if isinstance(error, DeadlineExceededError | TimeoutError):
        return str(error) or "deadline exceeded"
    return str(error) or type(error).__name__


def failure_reason(error: BaseException | None) -> str:
    """Why a transfer failed, as a bounded label value ("refused": a check failed, nothing moved).

    >>> failure_reason(PermissionDeniedError("wrong token")), failure_reason(TimeoutError())
    ('refused', 'deadline')
    """
    if error is None:
        return "none"
    if isinstance(error, OfferExpiredError):
        return "expired"  # a capacity signal (nobody pulled in time), not a refusal
    if isinstance(error, _REFUSALS):
        return "refused"
    if isinstance(error, DeadlineExceededError | TimeoutError):
        return "deadline"
    if isinstance(error, UnavailableError):
        return "unavailable"
    if isinstance(error, CancelledError | asyncio.CancelledError):
        return "cancelled"
    if isinstance(error, ResourceExhaustedError):
        return "resources"
    if isinstance(error, DataLossError):
        return "integrity"
    return "internal"


_PATH_NAMES = {common_pb2.TRANSFER_PATH_LOCAL: "local", common_pb2.TRANSFER_PATH_REMOTE: "remote"}
_RESULT_NAMES = {
    common_pb2.TRANSFER_STATE_SUCCEEDED: "succeeded",
    common_pb2.TRANSFER_STATE_CANCELLED: "cancelled",
}


@dataclass
class TransferRecord:
    transfer_id: str
    role: str  # "decode" (we pull) or "prefill" (a peer pulls from us)
    path: common_pb2.TransferPath.ValueType
    offer_id: str
    peer_daemon_id: str = ""
    transport: str = ""
    nbytes: int = 0
    state: common_pb2.TransferState.ValueType = common_pb2.TRANSFER_STATE_RUNNING
    started: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    duration_s: float = 0.0
    #: Time the bytes themselves moved (see PullResponse.data_plane_s).
    data_plane_s: float = 0.0
    #: GPU time of a GPU local copy (see PullResponse.device_s).
    device_s: float = 0.0
    #: How blocks were remapped between geometries (see PullResponse.mapping); "" if not.
    mapping: str = ""
    #: Decode side of a layer-wise transfer: told each time more layers have landed (the
    #: engine's LayersLanded event).
    on_layers: Callable[[int], None] | None = field(default=None, repr=False)
    #: "pull" or "push" (engine.proto, Push), and why (admin.proto, TransferInfo.mode_reason).
    mode: str = "pull"
    mode_reason: str = ""
    #: Block checksums (admin.proto, TransferInfo.integrity_*): the mode, blocks checked here,
    #: and the result ("ok", "mismatch", or why nothing was checked).
    integrity_mode: str = "off"
    integrity_blocks: int = 0
    integrity_result: str = ""
    detail: str = ""
    #: Pools whose memory this transfer touches (cancelled if one is deregistered).
    pools: tuple[str, ...] = ()
    #: Destination pool and block ids of a pull (idempotent retries compare it).
    dst_key: str = ""
    #: Set when this daemon cancels the transfer itself (not its peer): told to the peer.
    abort_detail: str = ""
    #: The receiver confirmed every byte (decode side: about to say so): past this point a
    #: cancel no longer applies, and the offer is released as pulled.
    committed: bool = False
    #: A receive of this (failed) pull was not confirmed cancelled by UCX.
    may_still_write: bool = False
    task: asyncio.Task[object] | None = None
    #: (phase, seconds since start) marks, logged with the transfer's end (where time goes).
    phases: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, phase: str) -> None:
        self.phases.append((phase, time.monotonic() - self.started_mono))

    def to_proto(self) -> admin_pb2.TransferInfo:
        duration = self.duration_s or (time.monotonic() - self.started_mono)
        return admin_pb2.TransferInfo(
            transfer_id=self.transfer_id,
            role=self.role,
            path=self.path,
            transport=self.transport,
            state=self.state,
            offer_id=self.offer_id,
            peer_daemon_id=self.peer_daemon_id,
            bytes=self.nbytes,
            started_unix=self.started,
            duration_s=duration,
            detail=self.detail,
            mapping=self.mapping,
            mode=self.mode,
            mode_reason=self.mode_reason,
            integrity_mode=self.integrity_mode,
            integrity_blocks=self.integrity_blocks,
            integrity_result=self.integrity_result,
        )


class TransferTable:
    def __init__(self, history: int, observe: Observer | None = None) -> None:
        self.active: dict[tuple[str, str], TransferRecord] = {}
        self.finished: deque[TransferRecord] = deque(maxlen=history)
        self._pulled: OrderedDict[str, TransferRecord] = OrderedDict()
        self._history = history
        self._observe = observe
        self.succeeded = 0
        self.failed = 0
        self.bytes_moved = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self, record: TransferRecord) -> TransferRecord:
        """Start ``record`` in the current task (which :meth:`abort` cancels)."""
        key = (record.role, record.transfer_id)
        if key in self.active:
            raise AlreadyExistsError(f"transfer {record.transfer_id!r} is already running")
        self.active[key] = record
        record.task = asyncio.current_task()
        self._idle.clear()
        return record

    def end(
        self,
        record: TransferRecord,
        state: common_pb2.TransferState.ValueType,
        detail: str = "",
        error: BaseException | None = None,
    ) -> None:
        """``record`` is over: into the history, the metrics and the log. ``error``: what
        failed it (its class gives the metrics' reason; a refusal moved nothing)."""
        self._finish(record, state, detail)
        if not self.active:
            self._idle.set()
        # A pull's metrics and log line are the largest Python step of a small handoff, and
        # nothing on its engine's path reads them: they follow once the answer is on its way
        # (its write is started in this turn of the loop; see control.call_stream). The
        # offering side's end is off every engine's path: reported at once, before the
        # offer's release reaches its engine.
        if record.role == "decode":
            try:
                asyncio.get_running_loop().call_soon(self._report, record, state, detail, error)
                return
            except RuntimeError:  # no loop running (a test, or the daemon winding down)
                pass
        self._report(record, state, detail, error)

    def _report(
        self,
        record: TransferRecord,
        state: common_pb2.TransferState.ValueType,
        detail: str,
        error: BaseException | None,
    ) -> None:
        """An ended transfer into the metrics and the log."""
        if self._observe is not None:
            reason = failure_reason(error) if state != common_pb2.TRANSFER_STATE_SUCCEEDED else "none"
            result = _RESULT_NAMES.get(state, "refused" if reason == "refused" else "failed")
            self._observe(
                EndedTransfer(
                    record.role,
                    _PATH_NAMES.get(record.path, "unknown"),
                    "none" if result == "refused" else record.transport,
                    result,
                    reason,
                    record.nbytes,
                    record.duration_s,
                )
            )
        fields: dict[str, Any] = {
            "transfer_id": record.transfer_id,
            "role": record.role,
            "offer_id": record.offer_id,
            "transport": record.transport or "-",
            "bytes": record.nbytes,
            "duration_s": round(record.duration_s, 6),
        }
        if record.integrity_result:
            result = record.integrity_result.split(":")[0].replace(" ", "-")  # "not checked: why" → not-checked
            fields["integrity"] = f"{record.integrity_mode}:{record.integrity_blocks}:{result}"
        if record.phases:
            fields["phases_ms"] = ",".join(f"{name}={t * 1e3:.2f}" for name, t in record.phases)
        if state == common_pb2.TRANSFER_STATE_SUCCEEDED:
            log_event("transfer.done", **fields)
        else:
            log_event("transfer.failed", reason=failure_reason(error), detail=detail, **fields)

    def abort(self, record: TransferRecord, detail: str) -> None:
        """Cancel a running transfer from this side; the peer is told ``detail`` (a cancelled
        stream handler alone would leave it waiting for its deadline). A committed transfer
        (every byte confirmed) is left to finish."""
        if record.committed:
            return
        record.abort_detail = record.abort_detail or detail
        if record.task is not None and not record.task.done():
            record.task.cancel()

    def abort_all(self, detail: str, where: Callable[[TransferRecord], bool] = lambda _: True) -> None:
        for record in list(self.active.values()):
            if where(record):
                self.abort(record, detail)

    async def cancel(self, records: list[TransferRecord], detail: str, timeout_s: float) -> bool:
        """Abort ``records`` and wait (up to ``timeout_s``) until they have unwound; True when
        one has not (it may still be writing)."""
        tasks = [r.task for r in records if r.task is not None and not r.task.done()]
        for r in records:
            self.abort(r, detail)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return any(not t.done() for t in tasks)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no transfer runs; False when ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def _finish(self, record: TransferRecord, state: common_pb2.TransferState.ValueType, detail: str = "") -> None:
        record.state = state
        record.detail = detail or record.detail  # a success may have said something on its way
        record.duration_s = time.monotonic() - record.started_mono
        # A finished record outlives its task in the history; the task (and an exception's
        # traceback with it) would keep the frames, and so the pools' memory, alive.
        record.task = None
        self.active.pop((record.role, record.transfer_id), None)
        self.finished.append(record)
        if state == common_pb2.TRANSFER_STATE_SUCCEEDED:
            if record.role == "decode":
                self._pulled[record.transfer_id] = record
                while len(self._pulled) > self._history:
                    self._pulled.popitem(last=False)
            self.succeeded += 1
            self.bytes_moved += record.nbytes
        else:
            self.failed += 1

    def succeeded_pull(self, transfer_id: str) -> TransferRecord | None:
        """A recent pull with this id that landed in full (kept for ``history`` transfers)."""
        return self._pulled.get(transfer_id)

    def find(self, transfer_id: str) -> list[TransferRecord]:
        """Running, cancellable transfers with this id (one per role at most). A transfer whose
        bytes the receiver already confirmed is finishing, not cancellable."""
        return [r for (_, tid), r in self.active.items() if tid == transfer_id and not r.committed]
