"""The scheduler side of the node's KV tier, as the connector's hooks reach it: the plan of
loads and saves (:mod:`._tier`), the daemon calls it makes, and the KV events of what landed
(:mod:`._kv_events`). Nothing here waits on the daemon."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .._blocking import KvxferClient
from .._results import PoolRef
from ._kv_events import RankReports, stored_event
from ._messages import RankPool
from ._tier import TierLoad, TierPlan, TierSave

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["TierSide"]


class TierSide:
    """One engine's tier on the scheduler side; ``events``: vLLM publishes KV events."""

    def __init__(self, block_size: int, salt: bytes, lease_s: float, events: bool) -> None:
        self.plan = TierPlan(block_size)
        self.block_size = block_size
        self.salt = salt
        self.lease_s = lease_s
        self._reports = RankReports() if events else None
        #: Requests with a tier load or save planned: (vLLM's block hashes, tokens), until its event is made.
        self._named: dict[str, tuple[Any, Any]] = {}
        self._ready: list[Any] = []

    def connect(self, offerer: KvxferClient, pools: dict[int, RankPool]) -> None:
        """The workers registered their pools: lookups become offers of the stored prefix,
        pinned for its load, which every rank pulls its heads of."""
        first, ranks = min(pools.items())[1], len(pools)

        def offer(keys: list[bytes]) -> Any:
            ref = PoolRef(first.pool_id, bytes.fromhex(first.offer_key))
            return offerer.start_tier_offer(ref, keys, salt=self.salt, lease_s=self.lease_s, readers=ranks, prefix=True)

        self.plan.offer = offer
        self.plan.release = lambda offer_id: offerer.start_release(offer_id)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        hit = self.plan.matched_tokens(
            request.request_id, request.block_hashes, request.num_prompt_tokens, num_computed_tokens
        )
        if hit[0] and self._reports is not None:
            self._named[request.request_id] = (request.block_hashes, request.all_token_ids)
        return hit

    def finished(self, request: Request, block_ids: list[int]) -> bool:
        """Store the request's computed full blocks; True when its blocks must wait for that."""
        self._named.pop(request.request_id, None)  # a hit it never loaded
        delay = self.plan.finished(request.request_id, request.block_hashes, request.num_computed_tokens, block_ids)
        if delay and self._reports is not None:
            self._named[request.request_id] = (request.block_hashes, request.all_token_ids)
        return delay

    def take(self) -> tuple[list[TierLoad], list[TierSave]]:
        """This step's loads and saves, each with its KV event when events are on."""
        loads, saves = self.plan.take()
        if self._reports is not None and (loads or saves):
            loads = [self._with_event(load, load.first, len(load.block_ids)) for load in loads]
            saves = [self._with_event(save, 0, len(save.keys)) for save in saves]
        return loads, saves

    def landed(self, connector_output: Any, ranks: int) -> None:
        """The workers' outputs of a step: their reports of what landed, and what vLLM heard
        ended on every rank (see :class:`~._kv_events.RankReports`)."""
        if self._reports is None:
            return
        self._reports.add(getattr(connector_output, "kv_cache_events", None))
        ended = {(rid, "store") for rid in connector_output.finished_sending or ()}
        ended |= {(rid, "load") for rid in connector_output.finished_recving or ()}
        self._ready += self._reports.ready(max(1, ranks), ended)

    def take_events(self) -> list[Any]:
        ready, self._ready = self._ready, []
        return ready

    def _with_event(self, op: Any, first: int, count: int) -> Any:
        named = self._named.pop(op.request_id, None)
        if named is None:
            return op
        return dataclasses.replace(op, event=stored_event(*named, first, count, self.block_size))
