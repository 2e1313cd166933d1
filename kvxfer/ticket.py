"""Tickets: what the prefill side hands the decode side so it can pull an offer.

A ticket is plain JSON (it rides inside a serving engine's ``kv_transfer_params``) and
carries a 128-bit capability token; whoever holds it can pull the offer once.

>>> t = Ticket("d1", "10.0.0.5:7461", "o1", bytes(16), 8, "f" * 32, 4096)
>>> Ticket.from_json(t.to_json()) == t
True
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError
from .proto import common_pb2

__all__ = ["TICKET_VERSION", "Ticket"]

TICKET_VERSION = 1
_TOKEN_BYTES = 16
_MAX_FIELD = 256
_MAX_READERS = 1024


@dataclass(frozen=True)
class Ticket:
    """A JSON-serialisable claim on one offer. Its repr leaves the token out (logs and
    tracebacks must not hand the offer to whoever reads them).

    >>> Ticket("d", "h:1", "off-1", b"\\x01" * 16, 2, "f", 8192)  # doctest: +NORMALIZE_WHITESPACE
    Ticket(daemon_id='d', peer_address='h:1', offer_id='off-1', num_blocks=2, fingerprint='f',
           total_bytes=8192, readers=1)
    """

    daemon_id: str
    peer_address: str
    offer_id: str
    token: bytes = field(repr=False)
    num_blocks: int
    fingerprint: str
    total_bytes: int
    #: Pulls the offer serves before it is released (decode ranks that each take their heads).
    readers: int = 1

    @classmethod
    def in_advance(
        cls,
        daemon_id: str,
        peer_address: str,
        fingerprint: str,
        num_blocks: int,
        bytes_per_block: int,
        readers: int = 1,
    ) -> Ticket:
        """A ticket for an offer not made yet: a fresh random offer id and token, which the
        offer is then made under (``OfferRequest.offer_id`` and ``token``).

        >>> t = Ticket.in_advance("d", "h:1", "f", 2, 64)
        >>> (t.offer_id[:4], len(t.offer_id), len(t.token), t.total_bytes)
        ('off-', 36, 16, 128)
        """
        if num_blocks <= 0:
            raise InvalidRequestError("a ticket needs at least one block")
        offer_id = "off-" + secrets.token_hex(16)
        token = secrets.token_bytes(_TOKEN_BYTES)
        total = num_blocks * bytes_per_block
        return cls(daemon_id, peer_address, offer_id, token, num_blocks, fingerprint, total, readers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": TICKET_VERSION,
            "daemon_id": self.daemon_id,
            "peer_address": self.peer_address,
            "offer_id": self.offer_id,
            "token": self.token.hex(),
            "num_blocks": self.num_blocks,
            "fingerprint": self.fingerprint,
            "total_bytes": self.total_bytes,
            "readers": self.readers,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> Ticket:
        """Parse and check a ticket dict; raise :class:`InvalidRequestError` when malformed."""
        if not isinstance(data, dict):
            raise InvalidRequestError("a ticket must be a JSON object")
        if data.get("v") != TICKET_VERSION:
            raise InvalidRequestError(f"unsupported ticket version {data.get('v')!r}")
        try:
            strings = {k: data[k] for k in ("daemon_id", "peer_address", "offer_id", "fingerprint")}
            ints = {k: data[k] for k in ("num_blocks", "total_bytes")}
            ints["readers"] = data.get("readers", 1)
            token = bytes.fromhex(data["token"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"malformed ticket: {exc!r}") from None
        for k, v in strings.items():
            if not isinstance(v, str) or not v or len(v) > _MAX_FIELD:
                raise InvalidRequestError(f"ticket field {k!r} must be a non-empty short string")
        for k, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InvalidRequestError(f"ticket field {k!r} must be a positive integer")
        if ints["readers"] > _MAX_READERS:
            raise InvalidRequestError(f"ticket field 'readers' must be at most {_MAX_READERS}")
        if len(token) != _TOKEN_BYTES:
            raise InvalidRequestError("ticket token must be 128 bits")
        return cls(
            strings["daemon_id"],
            strings["peer_address"],
            strings["offer_id"],
            token,
            ints["num_blocks"],
            strings["fingerprint"],
            ints["total_bytes"],
            ints["readers"],
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Ticket:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InvalidRequestError(f"ticket is not JSON: {exc}") from None
        return cls.from_dict(data)

    def to_proto(self) -> common_pb2.Ticket:
        return common_pb2.Ticket(
            version=TICKET_VERSION,
            daemon_id=self.daemon_id,
            peer_address=self.peer_address,
            offer_id=self.offer_id,
            token=self.token,
            num_blocks=self.num_blocks,
            fingerprint=self.fingerprint,
            total_bytes=self.total_bytes,
            readers=self.readers,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.Ticket) -> Ticket:
        return cls(
            msg.daemon_id,
            msg.peer_address,
            msg.offer_id,
            bytes(msg.token),
            msg.num_blocks,
            msg.fingerprint,
            msg.total_bytes,
            max(1, msg.readers),
        )
