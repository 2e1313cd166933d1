"""What readers outside the loop see of the node's KV tier: one immutable view per namespace
(``kvxferctl tier``, ``ListTier``, the ``kvxfer_tier_*`` metrics)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TierView"]


@dataclass(frozen=True)
class TierView:
    """One namespace of the node's KV tier."""

    namespace: str
    label: str
    chunks: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    disk_chunks: int = 0
    disk_bytes: int = 0
    disk_hits: int = 0
    disk_evictions: int = 0
    disk_failures: int = 0
