"""Engine sessions: one per connected engine, holding its event queue, pools and passed fds.

A session's id is the engine's capability: every request that acts on a pool or an offer
carries it, and only the session that created them may (DESIGN §2, "Ownership"). It is never
shown to operators; kvxferctl shows :attr:`Session.label` instead.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvxfer.errors import NotFoundError, PermissionDeniedError, ResourceExhaustedError
from kvxfer.proto import common_pb2, engine_pb2

from ._log import log_event
from .memory.process import EngineProcess

__all__ = ["MAX_PENDING_FDS", "Session", "SessionTable", "check_owner"]

#: File descriptors an engine may have passed and not yet used in a registration.
MAX_PENDING_FDS = 8192


@dataclass
class Session:
    engine_name: str
    session_id: str = field(default_factory=lambda: "sess-" + secrets.token_hex(16))
    #: What logs and kvxferctl show (the id itself is the engine's secret).
    label: str = field(default_factory=lambda: "s-" + secrets.token_hex(4))
    started: float = field(default_factory=time.time)
    events: asyncio.Queue[engine_pb2.EngineEvent] = field(default_factory=asyncio.Queue)
    pools: set[str] = field(default_factory=set)
    #: Descriptors passed over the fd socket, by handle, until a registration maps them.
    fds: dict[str, int] = field(default_factory=dict)
    #: The engine process attached on the fd socket (its memory can be registered as it is).
    process: EngineProcess | None = None
    closed: bool = False

    def emit(self, event: engine_pb2.EngineEvent) -> None:
        if not self.closed:
            self.events.put_nowait(event)

    def deposit_fds(self, fds: list[int]) -> list[str]:
        """Keep passed descriptors under fresh handles (the caller closes them on refusal)."""
        if len(self.fds) + len(fds) > MAX_PENDING_FDS:
            raise ResourceExhaustedError(f"more than {MAX_PENDING_FDS} passed descriptors not yet registered")
        handles = ["fd-" + secrets.token_hex(8) for _ in fds]
        self.fds.update(zip(handles, fds, strict=True))
        return handles

    def attach(self, process: EngineProcess) -> None:
        """Attach the engine process that connected on the fd socket (once per session)."""
        if self.process is not None:
            same = self.process.pid == process.pid
            process.end()
            if not same:
                raise PermissionDeniedError(
                    f"this session is attached to engine process {self.process.pid}; one session per process"
                )
            return
        self.process = process
        log_event("session.attach", session=self.label, pid=process.pid, uid=process.uid)

    def take_fd(self, handle: str) -> int | None:
        return self.fds.pop(handle, None)

    def close_fds(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)


class SessionTable:
    """Live engine sessions by id."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    def open(self, engine_name: str) -> Session:
        session = Session(engine_name[:256])
        self.sessions[session.session_id] = session
        log_event("session.open", session=session.label, engine=session.engine_name)
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"no session {session_id!r}: open one with WatchEvents first")
        return session

    def find(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def close(self, session: Session) -> list[str]:
        """The engine went away: forget the session; returns its pools (to deregister)."""
        session.closed = True
        self.sessions.pop(session.session_id, None)
        session.close_fds()
        if session.process is not None:
            session.process.end()  # pools still copying stop at their next chunk
        log_event("session.close", session=session.label, engine=session.engine_name)
        return list(session.pools)

    def tell_released(
        self, offer: Any, reason: common_pb2.ReleaseReason.ValueType, detail: str, transfer_id: str
    ) -> None:
        """An offer ended: tell the engine whose pool it was (the offer table's release sink)."""
        session = self.sessions.get(offer.session_id)
        if session is not None:
            released = engine_pb2.OfferReleased(
                offer_id=offer.offer_id,
                pool_id=offer.pool.pool_id,
                reason=reason,
                detail=detail,
                transfer_id=transfer_id,
            )
            session.emit(engine_pb2.EngineEvent(offer_released=released))


def tell_landed(sessions: SessionTable, pool: Any, transfer_id: str, layers: int) -> None:
    """Layers of a layer-wise transfer landed in ``pool``: tell the engine whose pool it is."""
    session = sessions.sessions.get(pool.session_id)
    if session is not None:
        landed = engine_pb2.LayersLanded(transfer_id=transfer_id, layers=layers)
        session.emit(engine_pb2.EngineEvent(layers_landed=landed))


def check_owner(owner_session_id: str, caller_session_id: str, what: str) -> None:
    """PERMISSION_DENIED unless the caller is the session that owns ``what``."""
    if not caller_session_id:
        raise PermissionDeniedError(
            f"{what}: the request names no session (send the session id from WatchEvents; kvxfer_client does)"
        )
    if not hmac.compare_digest(owner_session_id.encode(), caller_session_id.encode()):
        raise PermissionDeniedError(f"{what} belongs to another engine session")
