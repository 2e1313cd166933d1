"""Offers the prefill node's daemon refused: their blocks go back to vLLM.

The scheduler offers a finished request's blocks without waiting (``request_finished`` must
not), one offer per tensor-parallel rank; the answers arrive on the client's thread. A refusal
(the daemon went away, the pool is gone) means nobody can pull that request: its other ranks'
offers are withdrawn (also those answered later), vLLM gets the blocks back at the next
step (``finished_sending``), and the workers stop watching for releases that will not come.

>>> import concurrent.futures
>>> withdrawn = []
>>> refusals = RefusedOffers(withdrawn.append)
>>> ok, refused = concurrent.futures.Future(), concurrent.futures.Future()
>>> refusals.watch("r1", [ok, refused])
>>> refused.set_exception(RuntimeError("kvxferd is away"))
>>> ok.set_result(type("Ticket", (), {"offer_id": "o1"})())
>>> refusals.take(), withdrawn, refusals.for_workers(), refusals.for_workers()
({'r1'}, ['o1'], ['r1'], [])
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["RefusedOffers"]

log = logging.getLogger("vllm.kvxfer")


class RefusedOffers:
    """``release(offer_id)`` withdraws an offer (returns at once)."""

    def __init__(self, release: Callable[[str], Any]) -> None:
        self._release = release
        self._lock = threading.Lock()
        #: Refused requests not yet taken by the scheduler, and those taken but not yet told
        #: to the workers; what is known of each request's refusal until both are done.
        self._refused: set[str] = set()
        self._taken: set[str] = set()
        self._told: list[str] = []

    def watch(self, request_id: str, offers: list[concurrent.futures.Future[Any]]) -> None:
        """Follow one request's offers (one per rank) as they are answered."""
        for offer in offers:
            offer.add_done_callback(functools.partial(self._answered, request_id))

    def _answered(self, request_id: str, offer: concurrent.futures.Future[Any]) -> None:
        error = None if offer.cancelled() else offer.exception()
        with self._lock:
            refused = request_id in self._refused or request_id in self._taken
            if error is not None and not refused:
                self._refused.add(request_id)
        if error is None and refused and not offer.cancelled():
            self._release(offer.result().offer_id)  # answered after its sibling's refusal
        elif error is not None and not refused:
            log.error(
                "kvxfer: request %s: its KV could not be offered (%s); its blocks are freed, and the decode "
                "engine's pull of it fails (its kv_load_failure_policy applies). Check the prefill node's kvxferd.",
                request_id,
                error,
            )

    def take(self) -> set[str]:
        """The scheduler's step: requests refused since the last call (vLLM frees their blocks)."""
        with self._lock:
            taken, self._refused = self._refused, set()
            self._taken |= taken
            self._told.extend(sorted(taken))
        return taken

    def for_workers(self) -> list[str]:
        """This step's metadata: the requests the workers stop watching."""
        with self._lock:
            told, self._told = self._told, []
            self._taken.difference_update(told)
        return told
