"""This daemon's record in the registry, from its settings and what it found at start."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

from kvxfer.fleet import FleetRecord
from kvxfer.version import PROTOCOL_VERSION, __version__

from .._config import Settings

__all__ = ["own_record"]


def own_record(
    settings: Settings, daemon_id: str, addresses: tuple[str, str], ucx_transports: Sequence[str], gpus: int
) -> FleetRecord:
    """``addresses``: where peers and operators reach this daemon (peer, admin)."""
    transports = list(ucx_transports)
    if ucx_transports and settings.tcp_lanes != "off":
        transports.append("tcp-lanes")
    if ucx_transports and settings.same_host_direct_read:
        transports.append("direct-read")
    capabilities = ["push", "layerwise", "heterogeneous-tp", f"integrity:{settings.integrity}"]
    if settings.tier_host_bytes:
        capabilities.append("tier")
    return FleetRecord(
        daemon_id=daemon_id,
        peer_address=addresses[0],
        admin_address=addresses[1],
        version=__version__,
        protocol_version=PROTOCOL_VERSION,
        hostname=socket.gethostname(),
        started_at=time.time(),
        pid=os.getpid(),
        transports=tuple(transports),
        memory_kinds=("host", "cuda") if gpus else ("host",),
        tier_host_bytes=settings.tier_host_bytes,
        tier_disk_bytes=settings.tier_disk_bytes,
        capabilities=tuple(capabilities),
    )
