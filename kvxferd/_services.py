"""What every handoff and transport room shares, built once by the node and passed as one
value."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from ._config import Settings
from ._faults import Faults
from ._integrity import Integrity
from .dataplane.gpucopy import GpuDevices

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
