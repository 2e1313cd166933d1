"""The node tier in vLLM's KV events: what a KV-aware router sees of kvxfer.

vLLM publishes its prefix cache's changes as KV events (``--kv-events-config``, ZMQ); routers
such as llm-d's KV-cache indexer and Dynamo's KV router place requests by them. Blocks this
engine stored into the node's KV tier, and blocks it loaded from it, are held by the tier: each
store or load becomes one ``BlockStored`` event with ``medium="CPU"`` (the tier keeps chunks in
host memory, moving cold ones to NVMe), named by vLLM's own block hashes as the engine's own
events name them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` included), with tokens and parent.

The scheduler side makes the event when it plans the store or load (:func:`stored_event`) and
hands it to the workers with it; each worker gives it back once its own part landed (its
heads), through vLLM's ``get_kv_connector_kv_cache_events``; the scheduler publishes it once
every rank gave it back (:class:`RankReports`), in ``take_events``. A store or load that failed
on any rank is never published. Not reported: chunks other engines stored (the daemon's
``WatchTier`` stream tells of every chunk), chunks leaving the tier.

>>> event = stored_event([b"h0", b"h1", b"h2"], [5, 6, 7, 8, 9, 10, 11], first=1, count=2, block_size=2)
>>> event.token_ids, event.medium, event.parent_block_hash == maybe_convert_block_hash(b"h0")
([7, 8, 9, 10], 'CPU', True)
>>> event.block_hashes == [maybe_convert_block_hash(h) for h in (b"h1", b"h2")]  # as vLLM's own events
True
>>> reports = RankReports()
>>> reports.add(WorkerEvents([("r1", "load", event)]))       # rank 0 of 2
>>> reports.ready(ranks=2)
[]
>>> reports.add(WorkerEvents([("r1", "load", event)]))       # rank 1: now every rank has it
>>> reports.ready(ranks=2) == [event]
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

__all__ = ["RankReports", "WorkerEvents", "stored_event"]

#: One report: the request, "store" or "load", and its event.
Report = tuple[str, str, Any]


def stored_event(hashes: Sequence[Any], tokens: Sequence[int], first: int, count: int, block_size: int) -> BlockStored:
    """A request's blocks ``first`` to ``first + count`` (of its ``hashes``), held by the tier."""
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(h) for h in hashes[first : first + count]],
        parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
        token_ids=list(tokens[first * block_size : (first + count) * block_size]),
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_CPU,
        lora_name=None,
    )


class WorkerEvents(KVConnectorKVEvents):
    """What workers give back, as vLLM carries it from the workers to the scheduler (it merges
    the ranks' containers with ``add_events``/``get_all_events``): reports, by request and
    kind, so that two requests storing the same blocks are never counted as one."""

    def __init__(self, reports: list[Report] | None = None) -> None:
        self._reports: list[Report] = list(reports or [])
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._reports += events

    def aggregate(self) -> WorkerEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._reports)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._reports = []


class RankReports:
    """The scheduler's count of the ranks' reports, across steps (ranks finish in different
    steps): an event is ready once every rank reported its request's store or load."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], tuple[int, Any]] = {}

    def add(self, container: Any) -> None:
        """One step's reports, as vLLM hands them over (None, or another connector's: none)."""
        if not isinstance(container, WorkerEvents):
            return
        for request_id, kind, event in container.get_all_events():
            count, _ = self._counts.get((request_id, kind), (0, event))
            self._counts[(request_id, kind)] = (count + 1, event)

    def ready(self, ranks: int, ended: set[tuple[str, str]] = frozenset()) -> list[KVCacheEvent]:  # type: ignore[assignment]
        """Events every rank reported; ``ended``: (request, kind) vLLM heard ended on every
        rank this step (a rank reports its event in the step it reports the end): those not
        reported by all failed somewhere, and are dropped."""
        done = [key for key, (count, _) in self._counts.items() if count >= ranks]
        events = [self._counts.pop(key)[1] for key in done]
        for key in ended & self._counts.keys():
            del self._counts[key]
        return events
