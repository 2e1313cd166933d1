"""What the connector's scheduler side and its workers say to each other and to routers: the
keys it reads and writes in ``kv_transfer_params``, each rank's pool (vLLM's handshake), and
the loads, sends and streams of one step (the connector's metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "BLOCK_TOKENS_KEY",
    "MAX_STREAM_ID",
    "STREAM_KEY",
    "TICKETS_KEY",
    "UNAVAILABLE_KEY",
    "Load",
    "RankPool",
    "Send",
    "Stream",
    "stream_id",
    "stream_of",
]

#: Key of the per-rank tickets inside ``kv_transfer_params``.
TICKETS_KEY = "kvxfer_tickets"
#: Key of the prefill engine's block size (tokens) inside ``kv_transfer_params``.
BLOCK_TOKENS_KEY = "kvxfer_block_tokens"
#: Key of the router's streaming request inside ``kv_transfer_params`` (both engines).
STREAM_KEY = "kvxfer_stream"
#: Key of why a prefill engine handed nothing off (its kvxferd was away) inside
#: ``kv_transfer_params``: the answer then carries no ticket, ``do_remote_prefill`` is false and
#: the decode engine computes the prompt itself.
UNAVAILABLE_KEY = "kvxfer_unavailable"
#: The longest transfer id a router may choose (each rank's push adds a suffix, see stream_id).
MAX_STREAM_ID = 100


def stream_id(transfer_id: str, tp_rank: int) -> str:
    """The transfer id of one tensor-parallel rank's push (each rank has its own pool).

    >>> stream_id("abc", 1)
    'abc-r1'
    """
    return f"{transfer_id}-r{tp_rank}"


def stream_of(params: dict[str, Any] | None, prefill: bool) -> tuple[str, str] | str | None:
    """``(transfer_id, to_peer_address)`` of a streaming request, None when it does not
    stream, or why its ``kvxfer_stream`` is malformed (the router's, so checked).

    >>> stream_of({"kvxfer_stream": {"transfer_id": "x" * 200}}, prefill=False)
    'kvxfer_stream.transfer_id must be 1 to 100 characters'
    """
    stream = (params or {}).get(STREAM_KEY)
    if stream is None:
        return None
    if not isinstance(stream, dict):
        return f"{STREAM_KEY} must be an object"
    transfer_id, peer = stream.get("transfer_id"), stream.get("to_peer_address", "")
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_STREAM_ID:
        return f"{STREAM_KEY}.transfer_id must be 1 to {MAX_STREAM_ID} characters"
    if prefill and (not isinstance(peer, str) or not 0 < len(peer) <= 256):
        return f"{STREAM_KEY}.to_peer_address must name the decode node's kvxferd (host:port)"
    return transfer_id, str(peer)


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
    #: Receive the push of this transfer id (streaming) rather than pull the tickets.
    transfer_id: str = ""


@dataclass(frozen=True)
class Send:
    """Offer a finished prefill's ``block_ids`` under the tickets already handed out."""

    request_id: str
    block_ids: tuple[int, ...]
    tickets: tuple[dict[str, Any], ...]
    #: Decode ranks reading each rank's offer; a rank nobody reads makes no offer.
    readers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Stream:
    """Push a prefill's ``block_ids`` (its prompt's) under ``transfer_id``, layer by layer,
    in the step that computes its last prompt tokens."""

    request_id: str
    block_ids: tuple[int, ...]
    transfer_id: str
    to_peer_address: str
