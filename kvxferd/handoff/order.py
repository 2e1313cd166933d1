"""One pull as the handoff rooms pass it on: one value, never its parts position by position."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.ticket import Ticket

from .._transfers import TransferRecord
from ..memory.pools import Pool

__all__ = ["PullOrder"]


@dataclass
class PullOrder:
    """Under which record a pull runs, what it moves (the ticket, and the positions in the
    offer's list it takes, or all), where to (the destination pool and its block ids), and
    for how long."""

    record: TransferRecord
    ticket: Ticket
    dst: Pool
    dst_ids: np.ndarray[Any, Any]
    indices: np.ndarray[Any, Any] | None
    timeout_s: float
    #: The pull's own deadline; a remote pull lifts it once ``done`` is on its way.
    deadline: asyncio.Timeout | None = None
