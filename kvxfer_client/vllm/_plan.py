"""The scheduler side of the vLLM connector: which requests load and which send, step by step.

Nothing here touches KV memory or waits on the daemon: vLLM calls these hooks in its scheduler
loop. A prefill's ``request_finished`` answers at once with tickets made in advance (one per
tensor-parallel rank: each rank's worker has its own pool); the connector then offers the
blocks under them without waiting (with each pool's offer key, see ``RankPool``), and the
workers learn of the offers to report when they are released. The decode side turns the
tickets it receives into pulls.

``kv_transfer_params`` as vLLM's proxy passes them: the client asks the prefill engine with
``{"do_remote_decode": true}``; the prefill answers ``{"do_remote_prefill": true,
"kvxfer_tickets": [...]}``, which the proxy hands to the decode engine unchanged. Routers
written for other connectors (vLLM's toy proxy, ``vllm-router``) add keys of their own, or
ours set to null: a key this connector does not read is ignored, and a null one is as if
absent (a decode request with ``kvxfer_tickets: null`` computes its prompt itself).

Streaming (push, layer by layer): the router sends the request to both engines at once, with a
transfer id it chose (unguessable: 128 random bits) under ``kvxfer_stream``: to the prefill
engine ``{"do_remote_decode": true, "kvxfer_stream": {"transfer_id": T, "to_peer_address":
<the decode node's kvxferd peer address>}}``, to the decode engine ``{"do_remote_prefill": true,
"kvxfer_stream": {"transfer_id": T}}``. The step that computes a request's last prompt tokens
pushes its blocks (a :class:`Stream`), each layer leaving as the forward pass writes it; the
decode engine receives them. Both sides need the same tensor-parallel size (rank r pushes to
rank r).

>>> prefill = SchedulerPlan(block_size=16)
>>> prefill.set_pools({0: RankPool(0, "d1", "10.0.0.1:7461", "pool-1", "f" * 32, 4096, "00" * 16)})
>>> stream = {"transfer_id": "t" * 32, "to_peer_address": "10.0.0.2:7461"}
>>> prefill.expect_stream("r2", {"do_remote_decode": True, "kvxfer_stream": stream}, num_prompt_tokens=40)
>>> prefill.schedule_streams([("r2", [4, 5, 6], 0)], [], {"r2": 40})
>>> [(s.block_ids, s.to_peer_address) for s in prefill.take_streams()[0]]
[((4, 5, 6), '10.0.0.2:7461')]

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

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvxfer.errors import IncompatibleError
from kvxfer.geometry import readers
from kvxfer.ticket import Ticket

from ._groups import GROUPS_KEY, landing, spans_of
from ._messages import (
    BLOCK_TOKENS_KEY,
    STREAM_KEY,
    TICKETS_KEY,
    UNAVAILABLE_KEY,
    Load,
    RankPool,
    Send,
    Stream,
    stream_of,
)

__all__ = ["SchedulerPlan"]

log = logging.getLogger("vllm.kvxfer")


@dataclass
class _Expected:
    """A streaming prefill until the step that completes its prompt."""

    transfer_id: str
    to_peer_address: str
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


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
        self._streams: list[Stream] = []
        self._expected: dict[str, _Expected] = {}
        #: Streamed requests not finished yet, and those whose push ended before they finished.
        self._streamed: set[str] = set()
        self._sent_early: set[str] = set()
        #: Decode side: streamed loads not landed yet (request id → transfer id), and the
        #: transfer ids of those whose request ended meanwhile (their receives to cancel).
        self._receiving: dict[str, str] = {}
        self._cancels: list[str] = []
        #: Finished requests whose blocks vLLM holds until their send ends.
        self._held: set[str] = set()

    def set_pools(self, pools: dict[int, RankPool]) -> None:
        """Every rank's pool (called once the workers registered their KV caches)."""
        self.pools = dict(pools)

    # -- prefill --------------------------------------------------------------------------

    def finished(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        block_ids: list[int],
        daemon: tuple[str, str] | None = None,
        away: str = "",
    ) -> tuple[bool, dict[str, Any] | None, Send | None]:
        """A request finished: when a decode engine is to continue it, keep its blocks (True),
        answer with one ticket per rank, made here without a round trip, and return the
        :class:`Send` to offer under them. ``daemon``: the node's kvxferd as the scheduler's
        session knows it now, ``(daemon_id, peer_address)`` (default: as the workers said at
        start); ``away``: why it cannot be reached now: then no ticket is made (it would never
        work), the blocks are freed and the answer says why (:data:`UNAVAILABLE_KEY`).

        >>> plan = SchedulerPlan(block_size=16)
        >>> plan.set_pools({0: RankPool(0, "d1", "h:1", "pool-1", "f" * 32, 4096, "00" * 16)})
        >>> delay, params, send = plan.finished("r1", {"do_remote_decode": True}, [4], away="kvxferd is away")
        >>> delay, params[UNAVAILABLE_KEY], params["do_remote_prefill"], send
        (False, 'kvxferd is away', False, None)
        """
        if request_id in self._receiving:  # aborted while its push is awaited: stop waiting
            self._cancels.append(self._receiving.pop(request_id))
        if request_id in self._streamed or request_id in self._expected:
            # Streamed: its blocks stay until the push ends (unless it already has). Never
            # streamed (aborted before its last prompt step): nothing holds them; the decode
            # side's receive ends at its deadline.
            self._expected.pop(request_id, None)
            streamed = request_id in self._streamed and request_id not in self._sent_early
            self._streamed.discard(request_id)
            self._sent_early.discard(request_id)
            return streamed, None, None
        if not params or not params.get("do_remote_decode") or not block_ids:
            return False, None, None
        if not self.pools:
            raise IncompatibleError("no worker registered a KV pool with kvxferd (is the daemon running?)")
        if away:
            return False, {"do_remote_prefill": False, "do_remote_decode": False, UNAVAILABLE_KEY: away}, None
        tickets = tuple(
            Ticket.in_advance(
                *(daemon or (p.daemon_id, p.peer_address)),
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

    def expect_stream(self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int) -> None:
        """A new request: when the router asked for streaming, push its blocks in the step that
        completes its prompt (see :meth:`schedule_streams`). Nothing here raises: a request
        that cannot stream is logged and goes on as a pull."""
        if not params or not params.get("do_remote_decode"):
            return
        stream = stream_of(params, prefill=True)
        if stream is None:
            return
        if isinstance(stream, str):
            log.warning("kvxfer: request %s does not stream: %s", request_id, stream)
            return
        if self.decode_tp_size and self.decode_tp_size != len(self.pools):
            log.warning(
                "kvxfer: request %s does not stream: this engine has %d tensor-parallel ranks, the decode side %d "
                "(streaming pushes rank to rank; the router should not ask for it)",
                request_id,
                len(self.pools),
                self.decode_tp_size,
            )
            return
        self._expected[request_id] = _Expected(stream[0], stream[1], num_prompt_tokens)

    def schedule_streams(
        self,
        new: Iterable[tuple[str, list[int], int]],
        cached: Iterable[tuple[str, list[int] | None, int, bool]],
        num_scheduled_tokens: dict[str, int],
    ) -> None:
        """This step's scheduled requests (from vLLM's scheduler output): ``new`` as
        ``(request id, block ids, computed tokens)``, ``cached`` as ``(request id, new block
        ids, computed tokens, resumed)``. Streaming requests whose prompt this step completes
        become this step's :class:`Stream`."""
        if not self._expected:
            return
        steps: list[tuple[str, int]] = []
        for request_id, block_ids, computed in new:
            if request_id in self._expected:
                self._expected[request_id].block_ids = list(block_ids)
                steps.append((request_id, computed))
        for request_id, new_ids, computed, resumed in cached:
            if request_id in self._expected:
                expected = self._expected[request_id]
                expected.block_ids = list(new_ids or []) if resumed else expected.block_ids + list(new_ids or [])
                steps.append((request_id, computed))
        for request_id, computed in steps:
            expected = self._expected[request_id]
            if computed + num_scheduled_tokens.get(request_id, 0) < expected.num_prompt_tokens:
                continue  # an earlier chunk of a chunked prefill
            del self._expected[request_id]
            count = math.ceil(expected.num_prompt_tokens / self.block_size)
            blocks = tuple(expected.block_ids[:count])
            self._streams.append(Stream(request_id, blocks, expected.transfer_id, expected.to_peer_address))
            self._streamed.add(request_id)

    def take_streams(self) -> tuple[list[Stream], list[str]]:
        """This step's streams, and the streamed receives to cancel (their requests ended)."""
        streams, cancels, self._streams, self._cancels = self._streams, self._cancels, [], []
        return streams, cancels

    def received(self, finished_recving: Iterable[str]) -> None:
        """Loads that ended (landed or failed): nothing of theirs is left to cancel."""
        for request_id in finished_recving:
            self._receiving.pop(request_id, None)

    def hold(self, request_id: str) -> None:
        """vLLM keeps a finished request's blocks for us (``request_finished`` said so) until
        :meth:`sent` reports it."""
        self._held.add(request_id)

    def sent(self, finished_sending: set[str]) -> set[str]:
        """The finished sends vLLM is to hear of: those of requests whose blocks it holds for
        us, each once (vLLM asserts the request exists). Streamed requests vLLM has not
        finished yet (a push can end within the step that started it, before
        ``request_finished``) are remembered, and finish with their blocks free at once.

        >>> plan = SchedulerPlan(block_size=16)
        >>> plan.hold("r1"); plan.sent({"r1", "r2"}), plan.sent({"r1"})
        ({'r1'}, set())
        """
        early = finished_sending & self._streamed
        self._sent_early |= early
        done = (finished_sending - early) & self._held
        self._held -= done
        return done

    # -- decode ---------------------------------------------------------------------------

    def matched_tokens(
        self, params: dict[str, Any] | None, num_prompt_tokens: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens the tickets bring beyond what this engine has computed (loaded between
        steps, so True when there are any)."""
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if params.get(TICKETS_KEY) is None and params.get(STREAM_KEY) is None:  # null is absent (routers send it)
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
        cached = (len(block_ids) - len(new_ids)) * self.block_size  # tokens this engine holds
        src_tokens = params.get(BLOCK_TOKENS_KEY)
        src_tokens = self.block_size if src_tokens is None else src_tokens
        stream = stream_of(params, prefill=False) if tickets is None else None
        transfer_id = ""
        if isinstance(stream, str):
            self._loads.append(Load(request_id, (), new_ids, None, stream))
            return
        if stream is not None:
            # The prefill pushes its prompt's blocks: as many as these tokens fill.
            transfer_id, tickets = stream[0], []
            offered = math.ceil((cached + num_external_tokens) / src_tokens) if isinstance(src_tokens, int) else 0
        elif not isinstance(tickets, list) or not tickets or not all(isinstance(t, dict) for t in tickets):
            self._loads.append(Load(request_id, (), new_ids, None, f"kv_transfer_params carry no {TICKETS_KEY}"))
            return
        else:
            offered = int(tickets[0].get("num_blocks", 0) or 0)
        if not isinstance(src_tokens, int) or src_tokens <= 0 or not new_ids or offered <= 0:
            if new_ids:
                self._loads.append(Load(request_id, tuple(tickets), new_ids, None, "malformed kv_transfer_params"))
            return
        if cached % src_tokens:
            reason = (
                f"this engine's prefix cache holds {cached} tokens, not a whole number of the prefill's "
                f"{src_tokens}-token blocks: the pull cannot start mid-block"
            )
            self._loads.append(Load(request_id, tuple(tickets), new_ids, None, reason, transfer_id))
            return
        first = cached // src_tokens
        if first >= offered:
            return
        indices = tuple(range(first, offered)) if first else None
        if src_tokens == self.block_size:
            new_ids = new_ids[: offered - first]
        self._loads.append(Load(request_id, tuple(tickets), new_ids, indices, transfer_id=transfer_id))
        if transfer_id:
            self._receiving[request_id] = transfer_id

    def after_alloc_groups(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        dst: list[list[int | None]],
        new: list[list[bool]],
    ) -> None:
        """:meth:`after_alloc` for an engine with several KV-cache groups (:mod:`._groups`):
        ``dst`` each group's blocks (None: the null block), ``new`` which of them this
        engine's prefix cache does not hold. Pulls land group by group; the prefill must have
        the same groups and block size, and pull mode (streaming moves one group)."""
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # vLLM may call this twice: load once
        tickets = params.get(TICKETS_KEY)
        wanted = tuple(
            b
            for ids, fresh in zip(dst, new, strict=True)
            for b, f in zip(ids, fresh, strict=True)
            if f and b is not None
        )
        reason = ""
        if not isinstance(tickets, list) or not tickets or not all(isinstance(t, dict) for t in tickets):
            tickets = []
            reason = f"kv_transfer_params carry no {TICKETS_KEY}" + (
                f" (streaming moves one KV-cache group; this engine has {len(dst)})" if params.get(STREAM_KEY) else ""
            )
        elif params.get(BLOCK_TOKENS_KEY) not in (None, self.block_size):
            reason = f"the prefill's blocks hold {params.get(BLOCK_TOKENS_KEY)} tokens, these {self.block_size}: "
            reason += "with several KV-cache groups the block sizes must match"
        else:
            spans = spans_of(params.get(GROUPS_KEY), len(dst), int(tickets[0].get("num_blocks", 0) or 0))
            where = spans if isinstance(spans, str) else landing(spans, dst, new)
            if isinstance(where, str):
                reason = where
            elif where[1]:
                self._loads.append(Load(request_id, tuple(tickets), where[1], where[0]))
        if reason and wanted:
            self._loads.append(Load(request_id, tuple(tickets), wanted, None, reason))

    def take(self) -> tuple[list[Load], list[Send]]:
        """This step's loads and sends (the metadata for the workers); starts a new step."""
        loads, sends, self._loads, self._sends = self._loads, self._sends, [], []
        return loads, sends
