"""What the two sides tell each other over SGLang's ZMQ control sockets, and its checks.

A decode rank sends a prefill rank two messages, each a tag frame, a JSON frame and (for a
request) index frames:

- ``KVXFER_REG``, once per prefill rank a decode rank talks to: where the decode rank's
  daemon is (``peer_address``) and the ZMQ endpoint its status messages go to;
- ``KVXFER_ROOM``, once per request (SGLang's bootstrap room): the pages the decode rank
  allocated, its metadata slot, the nonce the transfer ids are made from, its daemon's peer
  address as it is now (a daemon restarted since the registration may listen elsewhere), and
  for a hybrid model the rows of each state component it allocated (a frame each).

A prefill rank sends a decode rank ``KVXFER_CHUNK`` for each chunk of a request's pages it
pushes (SGLang's chunked prefill): the request, the nonce the decode rank gave this prefill
rank, and which of the request's pages the push holds (from ``start``, ``count`` of them), so
the decode rank expects it while the prefill computes the next chunk.

Everything in them is checked as hostile: a malformed message is a
:class:`~kvxfer.errors.InvalidRequestError` (the prefill side logs and drops it).

>>> pages = np.arange(4, dtype=np.int32)
>>> frames = RoomInfo(7, "10.0.0.2:5000", 1, "ab" * 16, 3, True, 0, pages, "10.0.0.2:7000").to_frames()
>>> parse_room(frames).dst_pages.tolist()
[0, 1, 2, 3]
>>> mamba_slot = np.array([5], dtype=np.int32)
>>> with_state = RoomInfo(7, "10.0.0.2:5000", 1, "ab" * 16, 3, True, 0, pages, "", (mamba_slot,))
>>> [rows.tolist() for rows in parse_room(with_state.to_frames()).dst_states]
[[5]]
>>> parse_chunk(Chunk(7, "ab" * 16, 8, 4).to_frames())
Chunk(room=7, nonce='abababababababababababababababab', start=8, count=4)
>>> parse_chunk(Chunk(7, "ab" * 16, -1, 4).to_frames())
Traceback (most recent call last):
...
kvxfer_client.InvalidRequestError: kvxfer chunk message: pages -1 + 4
>>> parse_room([ROOM_TAG, b'{"room": "x"}', b""])
Traceback (most recent call last):
...
kvxfer_client.InvalidRequestError: kvxfer room message: 'room' must be int, not str
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.errors import InvalidRequestError

__all__ = [
    "CHUNK_TAG", "REG_TAG", "ROOM_TAG", "Chunk", "Registration", "RoomInfo", "parse_chunk", "parse_registration",
    "parse_room", "transfer_id",
]  # fmt: skip

REG_TAG = b"KVXFER_REG"
ROOM_TAG = b"KVXFER_ROOM"
CHUNK_TAG = b"KVXFER_CHUNK"
#: The most a JSON frame may hold, and the most pages one request may name (2^24 pages).
MAX_JSON = 4096
MAX_PAGES = 1 << 24
#: The most state components a request may name (SGLang has 13 kinds).
MAX_STATES = 32
_NONCE = re.compile(r"[0-9a-f]{32}")
_SESSION = re.compile(r"[0-9A-Za-z.:\[\]-]{1,250}:[0-9]{1,5}")


@dataclass(frozen=True)
class Registration:
    """A decode rank: its ZMQ session (``ip:port``), its daemon's peer address and id."""

    session: str
    peer_address: str
    daemon_id: str
    tp_size: int
    tp_rank: int

    def to_frames(self) -> list[bytes]:
        return [REG_TAG, json.dumps(self.__dict__).encode()]


@dataclass(frozen=True)
class RoomInfo:
    """One request's destination on one decode rank."""

    room: int
    session: str
    #: How many decode ranks send this prefill rank a destination for the room.
    required: int
    #: 128 random bits (hex) of the decode rank's, per request: the transfer ids' secret part.
    nonce: str
    aux_index: int
    #: Whether this prefill rank sends the request's metadata row too (one rank does).
    want_aux: bool
    decode_prefix_len: int
    dst_pages: np.ndarray[Any, Any]
    #: The decode rank's daemon now (it may have restarted elsewhere since the registration).
    peer_address: str = ""
    #: Rows allocated for each of the model's state components, in SGLang's order (empty:
    #: this rank expects none of it from this prefill rank).
    dst_states: tuple[np.ndarray[Any, Any], ...] = ()

    def to_frames(self) -> list[bytes]:
        head = {k: v for k, v in self.__dict__.items() if k not in ("dst_pages", "dst_states")}
        head["states"] = len(self.dst_states)
        indices = [self.dst_pages, *self.dst_states]
        return [ROOM_TAG, json.dumps(head).encode(), *(np.ascontiguousarray(i, dtype="<i4").tobytes() for i in indices)]

    def transfer_id(self, what: str) -> str:
        """The id of the push of ``what`` ("kv-0", "aux", "state-mamba") to this rank: each
        prefill rank gets a nonce of its own, so the id names the pair."""
        return transfer_id(self.nonce, what)

    # What SGLang's own code reads off a destination (``CommonKVManager._room_notify_targets``).
    @property
    def endpoint(self) -> str:
        return self.session.rsplit(":", 1)[0]

    @property
    def dst_port(self) -> int:
        return int(self.session.rsplit(":", 1)[1])

    is_dummy = False

    @property
    def required_dst_info_num(self) -> int:
        return self.required


@dataclass(frozen=True)
class Chunk:
    """A push of pages ``start`` to ``start + count`` of a request, from the prefill rank
    the decode rank gave ``nonce``."""

    room: int
    nonce: str
    start: int
    count: int

    def to_frames(self) -> list[bytes]:
        return [CHUNK_TAG, json.dumps(self.__dict__).encode()]

    def transfer_id(self) -> str:
        """The id of the push these pages go in."""
        return transfer_id(self.nonce, f"kv-{self.start}")


def transfer_id(nonce: str, what: str) -> str:
    """The transfer id of a push of ``what`` under ``nonce``.

    >>> transfer_id("ab" * 16, "kv")
    'sglang-abababababababababababababababab-kv'
    """
    return f"sglang-{nonce}-{what}"


def parse_registration(frames: list[bytes]) -> Registration:
    head = _json(frames, REG_TAG, 2, "registration")
    return Registration(
        _field(head, "session", str),
        _field(head, "peer_address", str),
        _field(head, "daemon_id", str),
        _field(head, "tp_size", int),
        _field(head, "tp_rank", int),
    )


def parse_room(frames: list[bytes]) -> RoomInfo:
    head = _json(frames[:2], ROOM_TAG, 2, "room")
    room = _field(head, "room", int, "room")
    nonce = _field(head, "nonce", str, "room")
    if not _NONCE.fullmatch(nonce):
        raise InvalidRequestError("kvxfer room message: the nonce is not 128 bits of hex")
    states = _field(head, "states", int, "room")
    if not 0 <= states <= MAX_STATES or len(frames) != 3 + states:
        raise InvalidRequestError(f"kvxfer room message: {len(frames)} frames for {states} state components")
    pages, *dst_states = (_indices(raw) for raw in frames[2:])
    session = _field(head, "session", str, "room")
    if not _SESSION.fullmatch(session):
        raise InvalidRequestError(f"kvxfer room message: session {session!r} is not host:port")
    return RoomInfo(
        room,
        session,
        _field(head, "required", int, "room"),
        nonce,
        _field(head, "aux_index", int, "room"),
        _field(head, "want_aux", bool, "room"),
        _field(head, "decode_prefix_len", int, "room"),
        pages,
        _field(head, "peer_address", str, "room"),
        tuple(dst_states),
    )


def parse_chunk(frames: list[bytes]) -> Chunk:
    head = _json(frames, CHUNK_TAG, 2, "chunk")
    nonce = _field(head, "nonce", str, "chunk")
    if not _NONCE.fullmatch(nonce):
        raise InvalidRequestError("kvxfer chunk message: the nonce is not 128 bits of hex")
    start, count = _field(head, "start", int, "chunk"), _field(head, "count", int, "chunk")
    if not (0 <= start < MAX_PAGES and 0 < count <= MAX_PAGES):
        raise InvalidRequestError(f"kvxfer chunk message: pages {start} + {count}")
    return Chunk(_field(head, "room", int, "chunk"), nonce, start, count)


def _indices(raw: bytes) -> np.ndarray[Any, Any]:
    """A frame of page or row indices (little-endian int32), none negative."""
    if len(raw) % 4 or len(raw) // 4 > MAX_PAGES:
        raise InvalidRequestError(f"kvxfer room message: {len(raw)} bytes of indices")
    indices = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    if indices.size and int(indices.min()) < 0:
        raise InvalidRequestError("kvxfer room message: a negative index")
    return indices


def _json(frames: list[bytes], tag: bytes, count: int, what: str) -> dict[str, Any]:
    if len(frames) != count or frames[0] != tag:
        raise InvalidRequestError(f"kvxfer {what} message: {len(frames)} frames")
    if len(frames[1]) > MAX_JSON:
        raise InvalidRequestError(f"kvxfer {what} message: a {len(frames[1])}-byte header")
    try:
        head = json.loads(frames[1])
    except ValueError as exc:
        raise InvalidRequestError(f"kvxfer {what} message: {exc}") from None
    if not isinstance(head, dict):
        raise InvalidRequestError(f"kvxfer {what} message: the header is not an object")
    return head


def _field(head: dict[str, Any], name: str, kind: type, what: str = "registration") -> Any:
    value = head.get(name)
    # bool is an int in Python: an int field takes no bool, a bool field no int.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequestError(
            f"kvxfer {what} message: {name!r} must be {kind.__name__}, not {type(value).__name__}"
        )
    if isinstance(value, str) and len(value) > 512:
        raise InvalidRequestError(f"kvxfer {what} message: {name!r} is {len(value)} characters")
    return value
