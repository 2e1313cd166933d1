"""Fault injection: named points in the handoff paths where a test makes the daemon pause or fail.

Off by default. A daemon takes fault points only at start, and only with both settings given:
``fault_injection: true`` and ``faults: "<point>=<action>[;<point>=<action>...]"``. A ``faults``
value without ``fault_injection`` is a configuration error (exit 2), so a stray environment
variable can never arm one in production; nothing at run time can arm or change them.

Points (where the daemon calls :meth:`Faults.hit`):

* ``after_accepted`` — offering side, right after it wrote ``accepted``;
* ``after_chunk_sent:N`` — offering side, once chunk ``N`` (0-based) has been sent;
* ``before_sent`` — offering side, every byte sent, before it says ``sent`` (a cancel here
  still fails both sides; from ``sent`` on it is too late);
* ``before_done`` — pulling side, every byte landed, before it writes ``done``;
* ``before_local_copy`` — local handoff, the offer claimed, before the first byte is copied;
* ``after_done_read`` — offering side, after it read ``done`` and released the offer as pulled,
  before it says ``closed``;
* ``before_closed_read`` — pulling side, after ``done`` went out and the pull succeeded, before
  it reads ``closed`` (off the engine's path);
* ``peer_endpoint`` — both sides, before an endpoint to a peer is made from its worker address;
* ``endpoint_broken`` — offering side, before it sends: a failing hit breaks the endpoint for
  good (every later send over it fails, as over the endpoint a frozen peer once left behind),
  so a test sees whether the daemon makes a new one;
* ``before_check`` — pulling side (remote or local), every byte landed, before the block
  checksums are checked: with ``corrupt``, one bit of the first landed block is flipped, as a
  fault on the way would;
* ``tier_disk_write`` — the KV tier, before a chunk evicted from host memory is written to
  disk: a failing hit is a failed write (the chunk is dropped and counted, never served).

Actions: ``pause:S`` (sleep S seconds, the event loop keeps running), ``fail`` (raise
:class:`~kvxfer_client.UnavailableError`, as a broken data plane would), ``fail:K`` (fail
the next K hits, then pass), and ``corrupt`` / ``corrupt:K`` (at ``before_check`` only: corrupt
every hit, or the next K). Each point logs ``fault.hit`` when it fires.

>>> f = Faults.parse("before_done=pause:0.01;peer_endpoint=fail:2")
>>> sorted(f.points)
['before_done', 'peer_endpoint']
>>> Faults.parse("nowhere=fail")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: faults: unknown point 'nowhere' (known: after_accepted, after_chunk_sent:N, ...)
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

from kvxfer.errors import UnavailableError

from ._log import log_event

__all__ = ["Faults"]

POINTS = (
    "after_accepted",
    "after_done_read",
    "before_sent",
    "before_check",
    "before_closed_read",
    "before_done",
    "before_local_copy",
    "endpoint_broken",
    "peer_endpoint",
    "registry_watch",
    "tier_disk_write",
)
_CHUNK_POINT = re.compile(r"^after_chunk_sent:(\d{1,9})$")
_ACTION = re.compile(r"^(pause:(\d+(\.\d+)?)|(fail|corrupt)(:(\d{1,9}))?)$")


@dataclass
class _Action:
    pause_s: float = 0.0
    #: Hits left that fail (or corrupt); -1 every hit.
    failures: int = 0
    corrupt: bool = False


class Faults:
    """The armed points of one daemon (empty, and free to call, when injection is off)."""

    def __init__(self, points: dict[str, _Action] | None = None) -> None:
        self.points = points or {}

    @classmethod
    def parse(cls, spec: str) -> Faults:
        points: dict[str, _Action] = {}
        for item in filter(None, (part.strip() for part in spec.split(";"))):
            point, _, action = item.partition("=")
            point, action = point.strip(), action.strip()
            if point not in POINTS and not _CHUNK_POINT.match(point):
                known = ", ".join(sorted((*POINTS, "after_chunk_sent:N")))
                raise ValueError(f"faults: unknown point {point!r} (known: {known})")
            m = _ACTION.match(action)
            if m is None:
                raise ValueError(
                    f"faults: {point}: action must be pause:SECONDS, fail[:COUNT] or corrupt[:COUNT], got {action!r}"
                )
            if (m.group(4) == "corrupt") != (point == "before_check"):
                raise ValueError(f"faults: {point}: corrupt goes with before_check, and before_check only with it")
            if m.group(2) is not None:
                points[point] = _Action(pause_s=float(m.group(2)))
            else:
                count = int(m.group(6)) if m.group(6) else -1
                points[point] = _Action(failures=count, corrupt=m.group(4) == "corrupt")
        return cls(points)

    def armed(self, point: str) -> bool:
        """Whether an action is armed at ``point`` (spent or not)."""
        return point in self.points

    def corrupts(self, point: str, transfer_id: str = "-") -> bool:
        """Whether this hit of ``point`` is to corrupt (a ``corrupt`` action with hits left)."""
        action = self.points.get(point)
        if action is None or not action.corrupt or action.failures == 0:
            return False
        if action.failures > 0:
            action.failures -= 1
        log_event("fault.hit", logging.WARNING, point=point, action="corrupt", transfer_id=transfer_id)
        return True

    async def hit(self, point: str, transfer_id: str = "-", peer: str = "-") -> None:
        """Run the action armed at ``point`` (nothing when none is)."""
        action = self.points.get(point)
        if action is None:
            return
        if action.pause_s:
            log_event(
                "fault.hit",
                logging.WARNING,
                point=point,
                action=f"pause:{action.pause_s}",
                transfer_id=transfer_id,
                peer=peer,
            )
            await asyncio.sleep(action.pause_s)
            return
        if action.failures == 0:
            return
        if action.failures > 0:
            action.failures -= 1
        log_event("fault.hit", logging.WARNING, point=point, action="fail", transfer_id=transfer_id, peer=peer)
        raise UnavailableError(f"fault injected at {point}")
