"""Keeping a waiting decode request's offers alive: the decode scheduler's lease heartbeat.

A prefill's offer lives ``lease_s`` (60 s) unless renewed. A decode request may wait longer
than that for its pull to start: queued behind others, or behind an engine step that takes
long. From the moment a request with tickets reaches the decode engine until its load ends (or
the request does), :class:`LeaseKeeper` renews its offers every third of a lease, from a thread
of its own: renewals never wait on an engine step, and a step never waits on them. A request
pulled at once costs no renewal at all (the first comes a third of a lease after arrival).

>>> renewed = []
>>> keeper = LeaseKeeper(lambda ticket: renewed.append(ticket["offer_id"]), lease_s=60.0)
>>> keeper.claim("r1", [{"offer_id": "o1"}], now=0.0)
>>> keeper.renew_due(now=10.0), keeper.renew_due(now=21.0), renewed
(0, 1, ['o1'])
>>> keeper.release(["r1"]); keeper.renew_due(now=99.0)
0
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["LeaseKeeper"]

log = logging.getLogger("vllm.kvxfer")


@dataclass
class _Claim:
    tickets: tuple[dict[str, Any], ...]
    renewed: float


class LeaseKeeper:
    """Renews the offers of claimed requests every ``lease_s / 3``; ``renew(ticket)`` starts
    one renewal and returns at once (its failure is the caller's to log)."""

    def __init__(self, renew: Callable[[dict[str, Any]], Any], lease_s: float) -> None:
        self._renew = renew
        self.lease_s = lease_s
        self.every_s = lease_s / 3
        self._claims: dict[str, _Claim] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LeaseKeeper:
        self._thread = threading.Thread(target=self._run, name="kvxfer-leases", daemon=True)
        self._thread.start()
        return self

    def claim(self, request_id: str, tickets: Iterable[Any], now: float | None = None) -> None:
        """``request_id`` waits for the offers of ``tickets`` (as ``kv_transfer_params`` carry
        them; anything else is ignored: the pull reports what is wrong with it)."""
        good = tuple(t for t in tickets if isinstance(t, dict))
        with self._lock:
            if good and request_id not in self._claims:
                self._claims[request_id] = _Claim(good, time.monotonic() if now is None else now)

    def release(self, request_ids: Iterable[str]) -> None:
        """These requests' loads ended, or the requests did: their offers need no more time."""
        with self._lock:
            for request_id in request_ids:
                self._claims.pop(request_id, None)

    def renew_due(self, now: float | None = None) -> int:
        """Start the renewals that are due; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [c for c in self._claims.values() if now - c.renewed >= self.every_s]
            for claim in due:
                claim.renewed = now
        tickets = [t for c in due for t in c.tickets]
        for ticket in tickets:
            self._renew(ticket)
        return len(tickets)

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, self.every_s / 4)):
            try:
                self.renew_due()
            except Exception:
                log.exception("kvxfer: lease renewal failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
