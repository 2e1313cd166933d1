"""The scheduler side of the vLLM connector: which requests load and which send, step by step.

Nothing here touches KV memory or waits on the daemon: vLLM calls these hooks in its scheduler
loop. A prefill's ``request_finished`` answers at once with tickets made in advance (one per
tensor-parallel rank: each rank's worker has its own pool); the connector then offers the
blocks under them without waiting (with each pool's offer key, see ``RankPool``), and the
workers learn of the offers to report when they are released. The decode side turns the
tickets it receives into pulls.

``kv_transfer_params`` as vLLM's proxy passes them: the client asks the prefill engine with
``{"do_remote_decode": true}``; the prefill answers ``{"do_remote_prefill": true,
"kvxfer_tickets": [...]}``, which the proxy hands to the decode engine unchanged.

>>> plan = SchedulerPlan(block_size=16)
>>> plan.set_pools({0: RankPool(0, "d1", "10.0.0.1:7461", "pool-1", "f" * 32, 4096, "00" * 16)})
>>> delay, params, send = plan.finished("r1", {"do_remote_decode": True}, [4, 5, 6])
>>> delay, sorted(params), len(params["kvxfer_tickets"])
(True, ['do_remote_decode', 'do_remote_prefill', 'kvxfer_block_tokens', 'kvxfer_tickets'], 1)
>>> decode = SchedulerPlan(block_size=16)
>>> decode.matched_tokens(params, num_prompt_tokens=40, num_computed_tokens=16)
(24, True)
>>> decode.after_alloc("r1", params, [9, 8, 7], num_external_tokens=24, num_new_blocks=2)
>>> loads, sends = decode.take()
>>> loads[0].block_ids, loads[0].offer_block_indices
((8, 7), (1, 2))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._errors import IncompatibleError
from .._geometry import readers
from .._ticket import Ticket

__all__ = ["TICKETS_KEY", "Load", "RankPool", "SchedulerPlan", "Send"]

#: Key of the per-rank tickets inside ``kv_transfer_params``.
TICKETS_KEY = "kvxfer_tickets"
#: Key of the prefill engine's block size (tokens) inside ``kv_transfer_params``.
BLOCK_TOKENS_KEY = "kvxfer_block_tokens"


@dataclass(frozen=True)
class RankPool:
    """One tensor-parallel rank's pool, as its worker tells the scheduler (vLLM's handshake)."""

    tp_rank: int
    daemon_id: str
    peer_address: str
    pool_id: str
    fingerprint: str
    bytes_per_block: int
    #: The pool's offer key (hex): the scheduler process offers the worker's blocks with it.
    offer_key: str


@dataclass(frozen=True)
class Load:
    """Pull a request's KV into ``block_ids``: the ticket of each rank, positions in it."""

    request_id: str
    tickets: tuple[dict[str, Any], ...]
    block_ids: tuple[int, ...]
    #: Positions in the tickets' block lists (None: all): the blocks this engine lacks.
    offer_block_indices: tuple[int, ...] | None
    #: Why this load cannot run (the worker reports it failed; vLLM's policy applies).
    refused: str = ""


@dataclass(frozen=True)
class Send:
    """Offer a finished prefill's ``block_ids`` under the tickets already handed out."""

    request_id: str
    block_ids: tuple[int, ...]
    tickets: tuple[dict[str, Any], ...]
    #: Decode ranks reading each rank's offer; a rank nobody reads makes no offer.
    readers: tuple[int, ...] = ()


class SchedulerPlan:
    def __init__(self, block_size: int, total_kv_heads: int = 0, decode_tp_size: int = 0) -> None:
        self.block_size = block_size
        #: The model's KV heads and the decode side's TP size: how many decode ranks read each
        #: prefill rank's offer (0: the same TP on both sides, one reader each).
        self.total_kv_heads = total_kv_heads
        self.decode_tp_size = decode_tp_size
        self.pools: dict[int, RankPool] = {}
        self._loads: list[Load] = []
        self._sends: list[Send] = []

    def set_pools(self, pools: dict[int, RankPool]) -> None:
        """Every rank's pool (called once the workers registered their KV caches)."""
        self.pools = dict(pools)

    # -- prefill --------------------------------------------------------------------------

    def finished(
        self, request_id: str, params: dict[str, Any] | None, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None, Send | None]:
        """A request finished: when a decode engine is to continue it, keep its blocks (True),
        answer with one ticket per rank, made here without a round trip, and return the
        :class:`Send` to offer under them."""
        if not params or not params.get("do_remote_decode") or not block_ids:
            return False, None, None
        if not self.pools:
            raise IncompatibleError("no worker registered a KV pool with kvxferd (is the daemon running?)")
        tickets = tuple(
            Ticket.in_advance(
                p.daemon_id,
                p.peer_address,
                p.fingerprint,
                len(block_ids),
                p.bytes_per_block,
                max(1, self.readers(rank)),
            ).to_dict()
            for rank, p in sorted(self.pools.items())
        )
        send = Send(request_id, tuple(block_ids), tickets, tuple(self.readers(rank) for rank in sorted(self.pools)))
        self._sends.append(send)
        params = {"do_remote_prefill": True, "do_remote_decode": False, TICKETS_KEY: list(tickets)}
        params[BLOCK_TOKENS_KEY] = self.block_size
        return True, params, send

    def readers(self, rank: int) -> int:
        """Decode ranks that pull from this rank's offer (0: a replica no decode rank needs)."""
        if not self.decode_tp_size or not self.total_kv_heads:
            return 1
        return readers(self.total_kv_heads, len(self.pools), self.decode_tp_size, rank)

    # -- decode ---------------------------------------------------------------------------

    def matched_tokens(
        self, params: dict[str, Any] | None, num_prompt_tokens: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens the tickets bring beyond what this engine has computed (loaded between
        steps, so True when there are any)."""
        if not params or not params.get("do_remote_prefill") or TICKETS_KEY not in params:
            return 0, False
        count = num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        block_ids: list[int],
        num_external_tokens: int,
        num_new_blocks: int,
    ) -> None:
        """Blocks are allocated for a request that loads: pull into the last
        ``num_new_blocks`` of them (the rest this engine's prefix cache already holds) the
        tickets' blocks from the first token this engine lacks. Blocks of the prefill engine
        may be another size (its ``kvxfer_block_tokens``): the daemon maps tokens between them.
        Nothing here raises (a step must not): a load that cannot run is handed to the worker
        as refused, and reported as failed."""
        if not params or not params.get("do_remote_prefill") or num_external_tokens == 0:
            return
        params["do_remote_prefill"] = False  # vLLM may call this twice: load once
        tickets = params.get(TICKETS_KEY)
        new_ids = tuple(block_ids[-num_new_blocks:]) if num_new_blocks > 0 else ()
        if not isinstance(tickets, list) or not tickets or not all(isinstance(t, dict) for t in tickets):
            self._loads.append(Load(request_id, (), new_ids, None, f"kv_transfer_params carry no {TICKETS_KEY}"))
            return
        offered = int(tickets[0].get("num_blocks", 0) or 0)
        src_tokens = params.get(BLOCK_TOKENS_KEY, self.block_size)
        if not isinstance(src_tokens, int) or src_tokens <= 0 or not new_ids or offered <= 0:
            if new_ids:
                self._loads.append(Load(request_id, tuple(tickets), new_ids, None, "malformed kv_transfer_params"))
            return
        cached = (len(block_ids) - len(new_ids)) * self.block_size  # tokens this engine holds
        if cached % src_tokens:
            reason = (
                f"this engine's prefix cache holds {cached} tokens, not a whole number of the prefill's "
                f"{src_tokens}-token blocks: the pull cannot start mid-block"
            )
            self._loads.append(Load(request_id, tuple(tickets), new_ids, None, reason))
            return
        first = cached // src_tokens
        if first >= offered:
            return
        indices = tuple(range(first, offered)) if first else None
        if src_tokens == self.block_size:
            new_ids = new_ids[: offered - first]
        self._loads.append(Load(request_id, tuple(tickets), new_ids, indices))

    def take(self) -> tuple[list[Load], list[Send]]:
        """This step's loads and sends (the metadata for the workers); starts a new step."""
        loads, sends, self._loads, self._sends = self._loads, self._sends, [], []
        return loads, sends
