"""What is inside a block: tokens, KV heads, their order, and which heads a tensor-parallel rank holds.

A layout may declare a :class:`KvGeometry`; every region is then one K or V plane of one layer,
each block of it ``block_tokens * kv_heads * head_bytes`` long, heads-major (``HND``: all of
head 0's tokens, then head 1's) or tokens-major (``NHD``: all heads of token 0, then token 1).
Two pools whose geometries differ only in tensor parallelism, head order or block size can
exchange blocks: the daemon maps each (layer, token, head) to its place on both sides.

Heads follow vLLM's rule: with ``tp_size <= total_kv_heads`` each rank holds an equal slice;
with more ranks than heads (GQA replication) each rank holds one head, shared by
``tp_size // total_kv_heads`` ranks. MLA's latent KV has one "head" every rank holds whole.

>>> rank_heads(total_kv_heads=8, tp_size=2, tp_rank=1)
HeadRange(first=4, count=4)
>>> rank_heads(total_kv_heads=2, tp_size=8, tp_rank=5)  # ranks 4..7 share head 1
HeadRange(first=1, count=1)
>>> [(s.tp_rank, s.heads.first, s.heads.count) for s in head_sources(8, prefill_tp=4, decode_tp=1, decode_rank=0)]
[(0, 0, 2), (1, 2, 2), (2, 4, 2), (3, 6, 2)]
>>> readers(8, prefill_tp=1, decode_tp=4, prefill_rank=0)
4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import IncompatibleError, InvalidRequestError
from .proto import common_pb2

__all__ = ["HeadRange", "HeadSource", "KvGeometry", "head_sources", "rank_heads", "readers"]

Order = Literal["HND", "NHD"]
_ORDERS: dict[str, int] = {"HND": common_pb2.HEAD_ORDER_HND, "NHD": common_pb2.HEAD_ORDER_NHD}


@dataclass(frozen=True)
class HeadRange:
    """Global KV heads ``first .. first + count - 1``."""

    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count

    def overlap(self, other: HeadRange) -> HeadRange | None:
        first, end = max(self.first, other.first), min(self.end, other.end)
        return HeadRange(first, end - first) if end > first else None


@dataclass(frozen=True)
class KvGeometry:
    """The inside of one block of one region (one K or V plane of one layer)."""

    block_tokens: int
    #: The model's KV heads before any tensor-parallel split (1 for MLA's latent KV).
    total_kv_heads: int
    #: Bytes of one head of one token (head size times element size).
    head_bytes: int
    order: Order = "HND"

    def check(self, tp_size: int, tp_rank: int, block_bytes: int) -> None:
        """Refuse a geometry that does not describe a region of ``block_bytes`` per block."""
        if min(self.block_tokens, self.total_kv_heads, self.head_bytes) <= 0:
            raise InvalidRequestError("geometry: block_tokens, total_kv_heads and head_bytes must be positive")
        if self.order not in _ORDERS:
            raise InvalidRequestError(f"geometry: order must be HND or NHD, got {self.order!r}")
        heads = rank_heads(self.total_kv_heads, tp_size, tp_rank)
        expected = self.block_tokens * heads.count * self.head_bytes
        if block_bytes != expected:
            raise InvalidRequestError(
                f"geometry: a region's blocks are {block_bytes} bytes, but {self.block_tokens} tokens x "
                f"{heads.count} heads (TP rank {tp_rank} of {tp_size}) x {self.head_bytes} bytes is {expected}"
            )

    def to_proto(self) -> common_pb2.KvGeometry:
        return common_pb2.KvGeometry(
            block_tokens=self.block_tokens,
            total_kv_heads=self.total_kv_heads,
            head_bytes=self.head_bytes,
            order=_ORDERS[self.order],  # type: ignore[arg-type]
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.KvGeometry) -> KvGeometry | None:
        """None when the message declares no geometry (``block_tokens`` 0)."""
        if msg.block_tokens == 0:
            return None
        order: Order = "NHD" if msg.order == common_pb2.HEAD_ORDER_NHD else "HND"
        return cls(msg.block_tokens, msg.total_kv_heads, msg.head_bytes, order)


def rank_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> HeadRange:
    """The global KV heads tensor-parallel rank ``tp_rank`` of ``tp_size`` holds."""
    if not 0 <= tp_rank < tp_size:
        raise InvalidRequestError(f"TP rank {tp_rank} is outside 0..{tp_size - 1}")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise IncompatibleError(f"{total_kv_heads} KV heads do not split evenly over TP {tp_size}")
        count = total_kv_heads // tp_size
        return HeadRange(tp_rank * count, count)
    if tp_size % total_kv_heads:
        raise IncompatibleError(f"TP {tp_size} is not a multiple of the {total_kv_heads} KV heads it replicates")
    return HeadRange(tp_rank // (tp_size // total_kv_heads), 1)


@dataclass(frozen=True)
class HeadSource:
    """A prefill rank a decode rank pulls from, and the heads it takes there."""

    tp_rank: int
    heads: HeadRange


def head_sources(total_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> list[HeadSource]:
    """The prefill ranks decode rank ``decode_rank`` pulls its heads from. Where prefill ranks
    replicate a head, decode ranks spread over the replicas (each replica then has readers)."""
    wanted = rank_heads(total_kv_heads, decode_tp, decode_rank)
    sources: list[HeadSource] = []
    for head in range(wanted.first, wanted.end):
        holders = [
            r for r in range(prefill_tp) if rank_heads(total_kv_heads, prefill_tp, r).overlap(HeadRange(head, 1))
        ]
        rank = holders[decode_rank % len(holders)]
        if sources and sources[-1].tp_rank == rank and sources[-1].heads.end == head:
            sources[-1] = HeadSource(rank, HeadRange(sources[-1].heads.first, sources[-1].heads.count + 1))
        else:
            sources.append(HeadSource(rank, HeadRange(head, 1)))
    return sources


def readers(total_kv_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int) -> int:
    """How many decode ranks pull from prefill rank ``prefill_rank``'s offer (0: none, it is a
    replica nobody needs)."""
    return sum(
        any(s.tp_rank == prefill_rank for s in head_sources(total_kv_heads, prefill_tp, decode_tp, d))
        for d in range(decode_tp)
    )
