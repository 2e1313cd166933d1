"""Wire values checked once, where they enter: tickets, transfer ids, leases, timeouts.

Every service converts a request's fields through these before the core sees them, so each
rule is written (and its error worded) in one place.

>>> lease_s(0, default=30.0, maximum=3600.0)
30.0
>>> lease_s(7200, default=30.0, maximum=3600.0)
Traceback (most recent call last):
...
kvxfer_client.InvalidRequestError: lease_s must be in (0, 3600.0], got 7200
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.errors import InvalidRequestError
from kvxfer.layout import MAX_BLOCKS, MAX_REGIONS
from kvxfer.proto import common_pb2
from kvxfer.ticket import Ticket

__all__ = ["MAX_PULL_TIMEOUT_S", "lease_s", "pull_timeout_s", "ticket", "transfer_id"]

#: Longest pull (and Transfer stream) a request may ask for.
MAX_PULL_TIMEOUT_S = 3600.0
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}$")


def ticket(msg: common_pb2.Ticket) -> Ticket:
    """A ticket from a request, refused (INVALID_ARGUMENT) unless it is well formed."""
    t = Ticket.from_proto(msg)
    if not t.offer_id or len(t.offer_id) > 128 or len(t.token) != 16:
        raise InvalidRequestError("malformed ticket (offer id or 16-byte token missing)")
    if not t.daemon_id or len(t.daemon_id) > 256:
        raise InvalidRequestError("malformed ticket (daemon id missing)")
    try:
        peer_address(t.peer_address)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"malformed ticket: {exc}") from None
    return t


def layers(value: int) -> int:
    """The layer count of a layer-wise offer (0: none), at most a layout's region count."""
    if value > MAX_REGIONS:
        raise InvalidRequestError(f"layers must be at most {MAX_REGIONS}")
    return value


def peer_address(value: str) -> str:
    """A daemon's peer address, host:port (IPv6 hosts in brackets)."""
    if not _ADDRESS.match(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        raise InvalidRequestError(f"peer address {value[:100]!r} is not host:port")
    return value


def transfer_id(value: str, required: bool = False) -> str:
    """A transfer id of 1..128 characters (empty allowed unless ``required``)."""
    if (required or value) and not 1 <= len(value) <= 128:
        raise InvalidRequestError("transfer_id must be 1..128 characters")
    return value


def lease_s(value: float, default: float | None, maximum: float) -> float:
    """A lease in (0, maximum]; 0 means ``default`` where one applies."""
    lease = value or default or 0.0
    if not 0 < lease <= maximum:
        raise InvalidRequestError(f"lease_s must be in (0, {maximum}], got {value}")
    return lease


def pull_timeout_s(value: float, default: float) -> float:
    """A pull's deadline in (0, 3600] seconds; 0 means ``default``."""
    timeout = value or default
    if not 0 < timeout <= MAX_PULL_TIMEOUT_S:
        raise InvalidRequestError(f"timeout_s must be in (0, {MAX_PULL_TIMEOUT_S:.0f}], got {value}")
    return timeout


#: An engine's offer ids are longer than the daemon's own ("off-" + 16 hex digits), so a pull
#: for an unknown id of the daemon's shape fails at once instead of waiting for an offer.
_CHOSEN_OFFER_ID = re.compile(r"^off-[0-9a-f]{32,64}$")


#: The most pulls one offer may serve (OfferRequest.readers): more than any TP size.
MAX_READERS = 1024


def readers(value: int) -> int:
    """``OfferRequest.readers``: 0 means one."""
    if value > MAX_READERS:
        raise InvalidRequestError(f"readers must be at most {MAX_READERS}, got {value}")
    return max(1, value)


def chosen_offer(offer_id: str, token: bytes) -> tuple[str, bytes] | None:
    """An offer id and token the engine picked in advance (both or neither), or None."""
    if not offer_id and not token:
        return None
    if not _CHOSEN_OFFER_ID.match(offer_id) or len(token) != 16:
        raise InvalidRequestError(
            "a chosen offer needs offer_id 'off-' + 32..64 lowercase hex digits and a 16-byte random token "
            "(kvxfer_client's new_ticket() makes both)"
        )
    return offer_id, bytes(token)


def offer_block_indices(values: Sequence[int]) -> npt.NDArray[np.int64] | None:
    """A pull's positions in the offer's block list (None: all). Their range and repeats are
    checked against the offer, which only the offering daemon knows for sure."""
    if not values:
        return None
    if len(values) > MAX_BLOCKS:
        raise InvalidRequestError(f"more than {MAX_BLOCKS} offer_block_indices")
    return np.asarray(values, dtype=np.int64)
