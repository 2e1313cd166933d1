"""Engine sessions: one per connected engine, holding its event queue and pools."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

from kvxfer_client._proto import engine_pb2

__all__ = ["Session"]


@dataclass
class Session:
    engine_name: str
    session_id: str = field(default_factory=lambda: "sess-" + secrets.token_hex(6))
    started: float = field(default_factory=time.time)
    events: asyncio.Queue[engine_pb2.EngineEvent] = field(default_factory=asyncio.Queue)
    pools: set[str] = field(default_factory=set)
    closed: bool = False

    def emit(self, event: engine_pb2.EngineEvent) -> None:
        if not self.closed:
            self.events.put_nowait(event)
