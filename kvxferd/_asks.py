"""What engines ask of the node, one value per act (checked for form where they entered, by
the control plane): an offer, a pull, a receive of a push. Each travels whole through the
layers below, never as its parts position by position."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.ticket import Ticket

__all__ = ["OfferAsk", "PullAsk", "ReceiveAsk"]


@dataclass(frozen=True)
class OfferAsk:
    """Pin ``block_ids`` of a pool under an offer: ``offer_key``, the pool's, when another
    session of its engine offers; ``chosen``, the id and token the engine picked in advance;
    ``readers``, the pulls it serves before it is released as pulled; ``layers``, the layers a
    layer-wise offer is written in."""

    session_id: str
    pool_id: str
    block_ids: Sequence[int]
    lease_s: float
    chosen: tuple[str, bytes] | None = None
    offer_key: bytes = b""
    readers: int = 1
    layers: int = 0


@dataclass(frozen=True)
class PullAsk:
    """Pull a ticket into ``block_ids`` of a pool within ``timeout_s``: ``indices``, the
    positions in the offer's list it takes (None: all); ``transfer_id``, a retryable pull's id
    (empty: a fresh one); ``pushed_by``, the daemon that announced it, for a push."""

    session_id: str
    pool_id: str
    ticket: Ticket
    block_ids: Sequence[int] | np.ndarray[Any, Any]
    timeout_s: float
    transfer_id: str = ""
    indices: np.ndarray[Any, Any] | None = None
    pushed_by: str = ""


@dataclass(frozen=True)
class ReceiveAsk:
    """Wait for the push of ``transfer_id`` (from ``from_daemon_id`` only, when given) and
    pull it into ``block_ids`` of a pool: one deadline for both."""

    session_id: str
    pool_id: str
    block_ids: Sequence[int]
    transfer_id: str
    timeout_s: float
    from_daemon_id: str = ""
    indices: np.ndarray[Any, Any] | None = None
