"""What every handoff and transport room shares, built once by the node and passed as one
value."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._config import Settings
from ._faults import Faults
from .dataplane.gpucopy import GpuDevices

if TYPE_CHECKING:  # the handoff rooms check integrity; the transports below them never do
    from .handoff.integrity import Integrity

__all__ = ["Services"]


@dataclass(frozen=True)
class Services:
    """The daemon's settings, its copy threads, its GPUs (opened on first need), its fault
    points and block integrity."""

    settings: Settings
    executor: Executor
    gpu: Callable[[], GpuDevices]
    faults: Faults
    integrity: Integrity
