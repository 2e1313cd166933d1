"""Setting UCX up for kvxferd: its environment defaults, who progresses the worker, and
what transport two workers will use.

UCX settings (applied unless already set in the environment, see :data:`UCX_DEFAULTS`):

* ``UCXPY_PROGRESS_MODE=blocking`` — UCX progresses on the event-loop thread. UCXX's default
  (a progress thread plus a notifier thread) adds a thread hop per completion: 4 MiB chunks
  moved at 3.4 GB/s with it and 6.9 GB/s without it here. UCXX's own blocking-mode driver
  spins a core forever once shared-memory endpoints exist (the worker never re-arms), so
  kvxferd replaces it with :class:`ProgressDriver`: tight progress while transfers run, a
  tick that slows down to :data:`IDLE_TICK_MAX_S` when idle.
* ``UCX_WARN_UNUSED_ENV_VARS=n`` — UCXX sets variables some builds ignore.
* ``UCX_RNDV_THRESH=65536`` — eager copies beyond 64 KiB cost more than one rendezvous.
* ``UCX_MAX_RNDV_RAILS=1`` — one lane per message; chunks already give parallelism.

Endpoint error handling is off towards a peer on the same host (``ucx_error_handling=auto``):
UCX's shared-memory and CMA transports have no peer-failure support, and with handling on UCX
falls back to TCP over loopback (≈0.8 GB/s instead of several GB/s measured here). Peer
failure is then detected by the control plane's deadlines instead.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from .._log import log_event

__all__ = [
    "UCX_DEFAULTS",
    "ProgressDriver",
    "apply_ucx_defaults",
    "describe_transport",
    "take_over_progress",
    "ucx_available",
]

UCX_DEFAULTS = {
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_RNDV_THRESH": "65536",
    "UCX_MAX_RNDV_RAILS": "1",
}

_SHARED_MEMORY_TLS = {"sysv", "posix", "cma", "xpmem", "knem"}
_RDMA_TLS = {"rc", "rc_verbs", "rc_mlx5", "dc", "dc_mlx5", "ud", "ud_verbs", "ud_mlx5"}


_defaults_logged = False


def apply_ucx_defaults() -> None:
    """Set :data:`UCX_DEFAULTS` that the environment leaves unset; call before importing
    ucxx (UCX reads some variables when the library loads). The first call logs, in one
    ``ucx.settings`` line, what it set and what the environment had set otherwise."""
    global _defaults_logged
    chosen, overridden = {}, {}
    for key, value in UCX_DEFAULTS.items():
        if key in os.environ and os.environ[key] != value:
            overridden[key] = os.environ[key]
        else:
            os.environ[key] = value
            chosen[key] = value
    if not _defaults_logged:
        _defaults_logged = True
        others = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "UCXPY_")) and k not in UCX_DEFAULTS}
        log_event(
            "ucx.settings", set=_pairs(chosen), environment_overrode=_pairs(overridden), environment=_pairs(others)
        )


def _pairs(values: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(values.items())) or "-"


def ucx_available() -> bool:
    apply_ucx_defaults()
    try:
        import ucxx  # noqa: F401
    except ImportError:
        return False
    return True


def describe_transport(
    ours: Sequence[str], theirs: Sequence[str], same_host: bool, error_handling: bool, gpu: bool = False
) -> str:
    """Name the transport UCX can pick between two workers, from their active transports.

    ``gpu``: this side's pool is GPU memory (its chunks are staged in GPU memory).

    >>> describe_transport(["cuda_ipc", "tcp"], ["cuda_ipc", "tcp"], True, False, gpu=True)
    'ucx:cuda_ipc'
    >>> describe_transport(["cuda_copy", "tcp"], ["cuda_copy", "tcp"], False, True, gpu=True)
    'ucx:tcp'
    """
    common = set(ours) & set(theirs)
    if gpu:
        if same_host and "cuda_ipc" in common:
            return "ucx:cuda_ipc"
        if common & _RDMA_TLS:
            return "ucx:rdma"
        if same_host and not error_handling and common & _SHARED_MEMORY_TLS:
            return "ucx:shm+cuda_copy"
    if same_host and not error_handling and common & _SHARED_MEMORY_TLS:
        return "ucx:shm+cma" if "cma" in common else "ucx:shm"
    if common & _RDMA_TLS:
        return "ucx:rdma"
    if "tcp" in common:
        return "ucx:tcp"
    return "ucx:" + "+".join(sorted(common)) if common else "ucx:none"


#: The idle tick starts here after a transfer and doubles up to :data:`IDLE_TICK_MAX_S`.
IDLE_TICK_S = 0.01
#: Between transfers nothing waits on the worker (every transfer wakes the driver as it
#: starts); the tick only keeps UCX's own housekeeping going (keepalives, wire-up answers).
#: Two idle daemons with a live peer each used 2.9% of a core at a fixed 10 ms tick, measured
#: here (``python -m bench.lean``).
IDLE_TICK_MAX_S = 0.2


class ProgressDriver:
    """Progresses the UCX worker on the event loop: every loop iteration while transfers are
    active; when idle, on a tick that slows from :data:`IDLE_TICK_S` to
    :data:`IDLE_TICK_MAX_S` (idle daemons then use no measurable CPU)."""

    def __init__(self, worker: Any, idle_s: float = IDLE_TICK_S, idle_max_s: float = IDLE_TICK_MAX_S) -> None:
        self._worker = worker
        self._idle_s = idle_s
        self._idle_max_s = idle_max_s
        self.active = 0
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._task = self._loop.create_task(self._run(), name="ucx-progress")

    @property
    def alive(self) -> bool:
        """False once progressing the worker failed: no UCX transfer can complete any more."""
        return not self._task.done()

    def busy(self) -> AbstractContextManager[None]:
        """``with driver.busy():`` around a transfer keeps progress tight while it runs."""
        return _Busy(self)

    async def _run(self) -> None:
        tick = self._idle_s
        while True:
            self._worker.progress()
            if self.active:
                tick = self._idle_s
                await asyncio.sleep(0)
                continue
            # A bare future and a timer: a wait_for per tick cost more than the progress call.
            self._waiter = waiter = self._loop.create_future()
            timer = self._loop.call_later(tick, _wake, waiter)
            await waiter
            timer.cancel()
            self._waiter = None
            tick = min(tick * 2, self._idle_max_s)

    def wake(self) -> None:
        """Progress now (a transfer starts)."""
        if self._waiter is not None:
            _wake(self._waiter)

    def stop(self) -> None:
        self._task.cancel()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Busy(AbstractContextManager[None]):
    def __init__(self, driver: ProgressDriver) -> None:
        self._driver = driver

    def __enter__(self) -> None:
        self._driver.active += 1
        self._driver.wake()

    def __exit__(self, *exc: object) -> None:
        self._driver.active -= 1


def take_over_progress(ucxx: Any) -> Any:
    """Silence UCXX's progress task for this loop and return the worker to drive ourselves.

    UCXX keeps one progress object per loop in ``ProgressTasks``; leaving the (now inert)
    entry there stops UCXX from starting another when endpoints are created.
    """
    from ucxx._lib_async import application_context

    loop = asyncio.get_running_loop()
    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress(loop)
    task = application_context.ProgressTasks.get(loop)
    if task is not None:
        try:
            loop.remove_reader(task.worker.epoll_file_descriptor)
        except (AttributeError, ValueError, OSError):
            pass
        for t in getattr(task, "_tasks", ()):
            if t is not None:
                t.cancel()
    return ctx.worker
