"""Transfer records: what is moving now, and a ring of what moved recently."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvxfer_client._errors import AlreadyExistsError
from kvxfer_client._proto import admin_pb2, common_pb2

__all__ = ["TransferRecord", "TransferTable"]


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
        )


class TransferTable:
    def __init__(self, history: int) -> None:
        self.active: dict[tuple[str, str], TransferRecord] = {}
        self.finished: deque[TransferRecord] = deque(maxlen=history)
        self._pulled: OrderedDict[str, TransferRecord] = OrderedDict()
        self._history = history
        self.succeeded = 0
        self.failed = 0
        self.bytes_moved = 0

    def start(self, record: TransferRecord) -> TransferRecord:
        key = (record.role, record.transfer_id)
        if key in self.active:
            raise AlreadyExistsError(f"transfer {record.transfer_id!r} is already running")
        self.active[key] = record
        return record

    def finish(self, record: TransferRecord, state: common_pb2.TransferState.ValueType, detail: str = "") -> None:
        record.state = state
        record.detail = detail
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
        return [r for (_, tid), r in self.active.items() if tid == transfer_id]
