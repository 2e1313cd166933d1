"""The other daemons of the cluster as the registry's watch left them.

>>> from kvxfer.fleet import FleetRecord
>>> m = Members("me")
>>> m.put(FleetRecord("b", "10.0.0.2:7461", "", "1", 3, "h", 0.0))
>>> m.address_of("b"), m.left_why("b")
('10.0.0.2:7461', '')
>>> m.drop("b", "its lease expired")
True
>>> m.address_of("b"), m.left_why("b")  # doctest: +ELLIPSIS
(None, 'its lease expired at ...')
>>> m.put(FleetRecord("b", "10.0.0.2:7470", "", "1", 3, "h", 0.0))  # back, on a new port
>>> m.address_of("b"), m.left_why("b")
('10.0.0.2:7470', '')
"""

from __future__ import annotations

import time

from kvxfer.fleet import FleetRecord

__all__ = ["Members"]

#: Daemons remembered as gone (a bounded set: the oldest are forgotten first).
_MAX_LEFT = 10_000


class Members:
    """Records by daemon id (ours excluded), and why the ones that left did."""

    def __init__(self, own_id: str) -> None:
        self.own_id = own_id
        self.records: dict[str, FleetRecord] = {}
        self._left: dict[str, str] = {}

    def put(self, record: FleetRecord) -> None:
        if record.daemon_id == self.own_id:
            return
        self.records[record.daemon_id] = record
        self._left.pop(record.daemon_id, None)

    def drop(self, daemon_id: str, why: str) -> bool:
        """The daemon's record left; True when it was one we knew."""
        known = self.records.pop(daemon_id, None) is not None
        if known:
            if len(self._left) >= _MAX_LEFT:
                self._left.pop(next(iter(self._left)))
            self._left[daemon_id] = f"{why} at {time.strftime('%H:%M:%S')}"
        return known

    def replace(self, records: list[FleetRecord]) -> list[str]:
        """A fresh listing; returns the ids that were known and are not in it."""
        listed = {r.daemon_id: r for r in records if r.daemon_id != self.own_id}
        gone = [i for i in self.records if i not in listed]
        for record in listed.values():
            self.put(record)
        return gone

    def address_of(self, daemon_id: str) -> str | None:
        record = self.records.get(daemon_id)
        return record.peer_address if record is not None else None

    def left_why(self, daemon_id: str) -> str:
        """Why the daemon left the registry ("" if it did not, or was never seen)."""
        return self._left.get(daemon_id, "")
