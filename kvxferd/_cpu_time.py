"""The CPU time of a step of the event loop that may hand work to a copy thread.

Wall time overstates such a step under load (other tasks run while it waits, other threads
hold the GIL), so a step is counted in CPU time: its own thread's, less what other tasks used
while it waited on a copy thread, plus that copy thread's.

>>> import asyncio
>>> from concurrent.futures import ThreadPoolExecutor
>>> async def step(pool: ThreadPoolExecutor) -> int:
...     return await in_thread(pool, sum, range(10**6))
>>> with ThreadPoolExecutor(1) as pool:
...     result, seconds = asyncio.run(cpu_timed(step(pool)))
>>> result, 0 < seconds < 5
(499999500000, True)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from contextvars import ContextVar
from typing import Any, TypeVar

__all__ = ["cpu_timed", "in_thread"]

T = TypeVar("T")
#: While a step is timed: CPU time of its thread that was not the step's.
_AWAY: ContextVar[list[float]] = ContextVar("cpu_time_away")


async def cpu_timed(work: Awaitable[T]) -> tuple[T, float]:
    """Await ``work``; its result and the CPU time it took (see the module docstring)."""
    away = [0.0]
    token, started = _AWAY.set(away), time.thread_time()
    try:
        result = await work
    finally:
        _AWAY.reset(token)
    return result, time.thread_time() - started - away[0]


async def in_thread(executor: Executor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in ``executor``, its CPU time counted toward the step awaiting it."""
    loop, waited = asyncio.get_running_loop(), time.thread_time()
    result, cpu = await loop.run_in_executor(executor, _on_cpu, fn, *args)
    away = _AWAY.get(None)
    if away is not None:
        away[0] += time.thread_time() - waited - cpu
    return result


def _on_cpu(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    started = time.thread_time()
    return fn(*args), time.thread_time() - started
