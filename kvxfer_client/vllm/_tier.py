"""The vLLM connector and the node's KV tier: prefixes already stored are loaded, not recomputed,
and finished requests' blocks are stored for the next turn (``kv_connector_extra_config``
``"tier": true``; the daemon needs ``tier_host_bytes``).

Keys are vLLM's own block hashes (``request.block_hashes``: each full block's tokens chained
with its predecessor's hash), so two requests with the same prefix name the same chunks; the
daemon's namespace keeps models, dtypes and layouts apart, ``tier_salt`` tenants.

Scheduler side (this module), without a daemon round trip inside a hook:

* ``get_num_new_matched_tokens``: the first call for a request asks the daemon to offer the
  longest stored prefix of the full blocks it lacks (the last prompt token is always
  computed) and answers ``None`` ("ask again"); a later call answers that prefix, to be
  loaded asynchronously. The offer pins its chunks in the tier, so what was found cannot be
  evicted before it is loaded (a plain lookup could be, and vLLM would fail the request).
* ``update_state_after_alloc``: the hit's blocks become a :class:`TierLoad` for the workers,
  which pull the offer's ticket into them (every rank takes its heads) and report the request
  received. A request that ends before its load releases the offer.
* ``request_finished``: the full blocks whose KV is computed become a :class:`TierSave`; the
  blocks stay with vLLM until the workers stored them (reported as finished sending).

>>> from concurrent.futures import Future
>>> from kvxfer_client import Ticket
>>> asked = []
>>> def offer(keys):
...     f = Future(); asked.append((keys, f)); return f
>>> plan = TierPlan(block_size=4, offer=offer)
>>> hashes = [b"h0", b"h1", b"h2"]                 # 13 prompt tokens: 3 full blocks
>>> plan.matched_tokens("r1", hashes, num_prompt_tokens=13, num_computed_tokens=4)
(None, False)
>>> asked[0][0], asked[0][1].set_result(Ticket("d", "h:1", "off-1", b"t" * 16, 1, "f", 64))
([b'h1', b'h2'], None)
>>> plan.matched_tokens("r1", hashes, num_prompt_tokens=13, num_computed_tokens=4)
(4, True)
>>> plan.after_alloc("r1", [7, 8, 9, 10], num_external_tokens=4)
>>> plan.finished("r1", hashes, num_computed_tokens=12, block_ids=[7, 8, 9, 10])
True
>>> loads, saves = plan.take()
>>> (loads[0].block_ids, loads[0].ticket["offer_id"]), (saves[0].block_ids, saves[0].keys)
(((8,), 'off-1'), ((7, 8, 9), (b'h0', b'h1', b'h2')))
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.ticket import Ticket

__all__ = ["TierLoad", "TierPlan", "TierSave"]

log = logging.getLogger("vllm.kvxfer")


@dataclass(frozen=True)
class TierLoad:
    """Pull the tier's offer of a stored prefix (its first ``len(block_ids)`` chunks) into
    ``block_ids``."""

    request_id: str
    block_ids: tuple[int, ...]
    ticket: dict[str, Any]
    #: The position of its first block in the request (its KV events name the blocks).
    first: int = 0
    #: vLLM's KV event for it, given back once loaded (None: KV events are off).
    event: Any = None


@dataclass(frozen=True)
class TierSave:
    """Store ``block_ids`` under ``keys``; the blocks are freed once every rank stored its heads."""

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    #: vLLM's KV event for it, given back once stored (None: KV events are off).
    event: Any = None


@dataclass
class _Lookup:
    keys: list[bytes]
    answer: concurrent.futures.Future[Ticket | None]


class TierPlan:
    def __init__(
        self,
        block_size: int,
        offer: Callable[[list[bytes]], concurrent.futures.Future[Ticket | None]] | None = None,
        release: Callable[[str], Any] = lambda offer_id: None,
    ) -> None:
        self.block_size = block_size
        #: Asks the daemon to offer the stored prefix of keys (None until the workers
        #: registered their pools); ``release`` withdraws an offer nobody will pull.
        self.offer = offer
        self.release = release
        self._lookups: dict[str, _Lookup] = {}
        #: Requests whose hit is to be loaded: the offer's ticket and the first block it fills.
        self._hits: dict[str, tuple[Ticket, int]] = {}
        self._loads: list[TierLoad] = []
        self._saves: list[TierSave] = []

    def matched_tokens(
        self, request_id: str, block_hashes: Sequence[bytes], num_prompt_tokens: int, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens the tier holds beyond what this engine computed (see the module docstring)."""
        first = num_computed_tokens // self.block_size
        last = (num_prompt_tokens - 1) // self.block_size  # the last prompt token is computed
        keys = [bytes(h) for h in block_hashes[first:last]]
        if not keys or self.offer is None:
            return 0, False
        pending = self._lookups.get(request_id)
        if pending is None or pending.keys != keys:
            if pending is not None:
                self._drop(pending)
            self._lookups[request_id] = _Lookup(keys, self.offer(keys))
            return None, False
        if not pending.answer.done():
            return None, False
        del self._lookups[request_id]
        try:
            ticket = pending.answer.result()
        except Exception as exc:  # noqa: BLE001 - a lookup that failed is a miss, never a failed step
            log.warning("kvxfer: tier lookup for request %s failed (computing it): %s", request_id, exc)
            return 0, False
        if ticket is None:
            return 0, False
        self._hits[request_id] = (ticket, first)
        return min(ticket.num_blocks, len(keys)) * self.block_size, True

    def after_alloc(self, request_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks are allocated: the hit's become this step's :class:`TierLoad`."""
        hit = self._hits.pop(request_id, None)
        if hit is None:
            return
        ticket, first = hit
        count = min(ticket.num_blocks, num_external_tokens // self.block_size, len(block_ids) - first)
        if count <= 0:
            self.release(ticket.offer_id)  # vLLM took none of it
            return
        self._loads.append(TierLoad(request_id, tuple(block_ids[first : first + count]), ticket.to_dict(), first))

    def finished(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int, block_ids: list[int]
    ) -> bool:
        """A request finished: store its full blocks whose KV is computed; True when its
        blocks must wait for that."""
        pending = self._lookups.pop(request_id, None)
        if pending is not None:
            self._drop(pending)
        hit = self._hits.pop(request_id, None)
        if hit is not None:  # ended before its load was planned
            self.release(hit[0].offer_id)
        count = min(len(block_hashes), num_computed_tokens // self.block_size, len(block_ids))
        if count <= 0:
            return False
        keys = tuple(bytes(h) for h in block_hashes[:count])
        self._saves.append(TierSave(request_id, tuple(block_ids[:count]), keys))
        return True

    def _drop(self, lookup: _Lookup) -> None:
        """A lookup nobody will use: release the offer it makes, once it answers."""

        def release(answer: concurrent.futures.Future[Ticket | None]) -> None:
            if not answer.cancelled() and answer.exception() is None and (ticket := answer.result()) is not None:
                self.release(ticket.offer_id)

        lookup.answer.add_done_callback(release)

    def take(self) -> tuple[list[TierLoad], list[TierSave]]:
        loads, saves, self._loads, self._saves = self._loads, self._saves, [], []
        return loads, saves
