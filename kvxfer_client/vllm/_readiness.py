"""Whether the workers' pools are registered on the daemon the scheduler reaches now.

The scheduler hands out tickets for blocks its workers registered; it offers them with its own
session. After the daemon restarts, each process of the engine reconnects on its own: the
scheduler's session can be back a moment before a worker has registered its pool again, and an
offer made then is refused (no such pool) after its tickets went out, so the decode engine's
pull fails. So after the scheduler's session was lost, it hands out tickets again only once
every worker says (through vLLM's worker metadata, :class:`~._metadata.KvxferWorkerMeta`) that it
registered its pool after that loss; meanwhile a finished request goes out without tickets (the
decode engine computes it). Should a worker never say so (only the scheduler's session was
lost; the pools never left), the wait ends after :data:`RESTORE_WAIT_S`.

>>> back = PoolsBack(ranks=2)
>>> back.ready(lost_at=0.0, now=5.0)  # never lost
True
>>> back.ready(lost_at=100.0, now=101.0)  # lost; no worker has registered again since
False
>>> back.heard({0: 100.5}); back.heard({1: 99.0}); back.ready(lost_at=100.0, now=101.0)
False
>>> back.heard({1: 100.7}); back.ready(lost_at=100.0, now=101.0)
True
>>> PoolsBack(ranks=1).ready(lost_at=100.0, now=100.0 + RESTORE_WAIT_S + 1)  # none said: waited enough
True
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["RESTORE_WAIT_S", "PoolsBack"]

#: How long after losing its session the scheduler waits, at most, for its workers to say their
#: pools are registered again.
RESTORE_WAIT_S = 10.0


class PoolsBack:
    """The latest time each rank's worker registered its pool again (``time.monotonic()``)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._restored: dict[int, float] = {}

    def heard(self, restored: Mapping[int, float]) -> None:
        """What the workers said this step (rank: when they last registered again)."""
        for rank, at in restored.items():
            self._restored[rank] = max(at, self._restored.get(rank, 0.0))

    def ready(self, lost_at: float, now: float) -> bool:
        """Whether tickets may go out: the scheduler's session was never lost, every rank
        registered again since, or the wait for them is over."""
        if not lost_at or now > lost_at + RESTORE_WAIT_S:
            return True
        return all(self._restored.get(rank, 0.0) > lost_at for rank in range(self.ranks))
