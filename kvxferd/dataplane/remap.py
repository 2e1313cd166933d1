"""Segments of a handoff between two geometries: other heads, other head order, other block size.

When both pools declare a :class:`~kvxfer_client.KvGeometry`, the stream is the source's own
order restricted to what moves: for each region (one K or V plane of one layer), each source
block in the ticket's order, its tokens and heads as the source stores them, only the heads
both ranks hold. Each side turns every (region, token, head) unit of that stream into an offset
in its own memory, then merges units that touch into segments; the sender gathers its
segments into chunks, the receiver scatters the same chunks into its own. Same geometry on
both sides: one segment per region and block, exactly what :func:`~.plan.build_plan` makes.

Units are as large as both orders allow: a head's run of tokens when both sides are
heads-major (``HND``), a token's run of heads when both are tokens-major (``NHD``), one head of
one token when the orders differ (the conversion happens in the same copy, no second pass).
Everything is numpy arithmetic over the units, no Python loop over blocks, tokens or heads.

>>> import numpy as np
>>> from kvxfer.geometry import HeadRange
>>> two_heads = RegionTable.from_regions([(0, 0, 64, 64)])  # blocks of 4 tokens x 2 heads x 8 bytes
>>> one_head = RegionTable.from_regions([(0, 0, 32, 32)])
>>> src = Side(two_heads, np.array([1, 0]), block_tokens=4, heads=HeadRange(0, 2), head_bytes=8, order="HND")
>>> dst = Side(one_head, np.array([0, 2]), block_tokens=4, heads=HeadRange(1, 1), head_bytes=8, order="HND")
>>> s, d = remap(src, dst)  # a decode rank of TP 2 takes head 1: one run per block and side
>>> s.offset.tolist(), s.nbytes.tolist(), d.offset.tolist(), d.nbytes.tolist()
([96, 32], [32, 32], [0, 64], [32, 32])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.errors import IncompatibleError, InvalidRequestError
from kvxfer.geometry import HeadRange, KvGeometry, rank_heads
from kvxfer.layout import Layout, ModelInfo
from kvxfer.proto import common_pb2

from .plan import RegionTable, SidePlan, plan_segments

__all__ = ["MAX_UNITS", "Segments", "Side", "peer_side", "plan_remap", "remap", "remap_plans", "side_of"]

I64 = npt.NDArray[np.int64]
#: The most (region, token, head) units one remap plans: its arrays take ~40 bytes per unit.
MAX_UNITS = 1 << 24


@dataclass(frozen=True)
class Side:
    """One end of a remapped handoff: its regions, the blocks it moves, what is inside them."""

    regions: RegionTable
    block_ids: I64
    block_tokens: int
    #: The global KV heads this side's pool holds.
    heads: HeadRange
    head_bytes: int
    order: Literal["HND", "NHD"]

    def offsets(self, token: I64, head: I64) -> I64:
        """Byte offsets ``[region, unit]`` of the (token, global head) units in every region:
        the per-unit arithmetic is done once, regions are added by broadcasting."""
        slot = token % self.block_tokens
        local = head - self.heads.first
        inner = local * self.block_tokens + slot if self.order == "HND" else slot * self.heads.count + local
        block = self.block_ids[token // self.block_tokens]
        regions = self.regions
        per_unit = inner * self.head_bytes
        out = regions.stride[:, None] * block[None, :]  # the one [region, unit] array: added to in place
        out += regions.offset[:, None]
        out += per_unit[None, :]
        return out


@dataclass(frozen=True)
class Segments:
    """One side's segments in stream order."""

    buffer: I64
    offset: I64
    nbytes: I64


def remap(src: Side, dst: Side) -> tuple[Segments, Segments]:
    """Both sides' segments for moving the heads both hold, for every token of ``src``'s
    blocks that ``dst``'s blocks have room for."""
    token, head, unit = _checked_units(src, dst)
    return _merge(src, token, head, unit), _merge(dst, token, head, unit)


def _checked_units(src: Side, dst: Side) -> tuple[I64, I64, int]:
    """The stream's units (see :func:`_units`), once the two sides are checked compatible."""
    if len(src.regions.offset) != len(dst.regions.offset):
        raise IncompatibleError(f"region count differs: {len(src.regions.offset)} vs {len(dst.regions.offset)}")
    if src.head_bytes != dst.head_bytes:
        raise IncompatibleError(f"head size differs: {src.head_bytes} vs {dst.head_bytes} bytes per head and token")
    small, large = sorted((src.block_tokens, dst.block_tokens))
    if large % small:
        raise IncompatibleError(f"block sizes {src.block_tokens} and {dst.block_tokens}: one must divide the other")
    heads = src.heads.overlap(dst.heads)
    if heads is None:
        raise IncompatibleError(f"the offer holds heads {_span(src.heads)}, this pool {_span(dst.heads)}: none shared")
    tokens = min(len(src.block_ids) * src.block_tokens, len(dst.block_ids) * dst.block_tokens)
    for side, name in ((src, "offered"), (dst, "destination")):
        if len(side.block_ids) * side.block_tokens - tokens >= side.block_tokens:
            raise InvalidRequestError(
                f"{len(side.block_ids)} {name} blocks of {side.block_tokens} tokens for {tokens} tokens: "
                f"{name} blocks go unused (offered {len(src.block_ids)} x {src.block_tokens}, "
                f"destination {len(dst.block_ids)} x {dst.block_tokens})"
            )
    units = _unit_count(src, dst, heads, tokens, small)
    if units > MAX_UNITS:
        raise InvalidRequestError(
            f"this remap moves {units} pieces (more than {MAX_UNITS}): declare larger head_bytes or pull fewer blocks"
        )
    return _units(src, dst, heads, tokens, small)


def plan_remap(src: Side, dst: Side, chunk_bytes: int, side: Literal["src", "dst"]) -> SidePlan:
    """One side's chunk plan of a remapped handoff (each daemon plans only its own side)."""
    token, head, unit = _checked_units(src, dst)
    segs = _merge(src if side == "src" else dst, token, head, unit)
    return plan_segments(segs.buffer, segs.offset, segs.nbytes, chunk_bytes)


class _Pool(Protocol):
    @property
    def layout(self) -> Layout: ...
    @property
    def regions(self) -> RegionTable: ...


def side_of(layout: Layout, regions: RegionTable, block_ids: I64) -> Side:
    """A pool with a declared geometry as one side of a remap (``regions``: its RegionTable;
    a peer's side may be described by its signature and a stand-in table)."""
    g = layout.geometry
    if g is None:
        raise IncompatibleError("only pools that declare a KvGeometry can be remapped")
    heads = rank_heads(g.total_kv_heads, max(1, layout.model.tp_size), layout.model.tp_rank)
    return Side(regions, np.asarray(block_ids, dtype=np.int64), g.block_tokens, heads, g.head_bytes, g.order)


def peer_side(
    signature: common_pb2.LayoutSignature,
    num_blocks: int,
    regions: RegionTable | None = None,
    block_ids: I64 | None = None,
) -> Side:
    """The other daemon's side, from its signature: enough to plan this side. ``regions`` and
    ``block_ids``: where its blocks lie, when it said so (a direct read plans its side too);
    else stand-ins whose offsets are never used."""
    layout = Layout(
        max(1, num_blocks), (), ModelInfo.from_proto(signature.model), KvGeometry.from_proto(signature.geometry)
    )
    if regions is None:
        regions = RegionTable.from_regions([(0, 0, 0, n) for n in signature.block_bytes])
    ids = np.arange(num_blocks, dtype=np.int64) if block_ids is None else block_ids
    return side_of(layout, regions, ids)


def remap_plans(src: _Pool, src_ids: I64, dst: _Pool, dst_ids: I64, chunk_bytes: int) -> tuple[SidePlan, SidePlan]:
    """Both sides' plans of a local remapped handoff."""
    s, d = remap(side_of(src.layout, src.regions, src_ids), side_of(dst.layout, dst.regions, dst_ids))
    return (
        plan_segments(s.buffer, s.offset, s.nbytes, chunk_bytes),
        plan_segments(d.buffer, d.offset, d.nbytes, chunk_bytes),
    )


def _unit_count(src: Side, dst: Side, heads: HeadRange, tokens: int, small: int) -> int:
    regions = len(src.regions.offset)
    if src.order == dst.order == "HND":
        return regions * heads.count * (tokens // small)
    if src.order == dst.order == "NHD":
        return regions * tokens
    return regions * tokens * heads.count


def _units(src: Side, dst: Side, heads: HeadRange, tokens: int, small: int) -> tuple[I64, I64, int]:
    """(first token, first head) of every unit of one region in stream order (every region
    has the same units; regions come first in the stream), and the unit's bytes."""
    hb = src.head_bytes
    h = np.arange(heads.first, heads.end, dtype=np.int64)
    src_blocks = np.arange(-(-tokens // src.block_tokens), dtype=np.int64)
    if src.order == dst.order == "HND":
        # Units: one head's run of `small` tokens (`tokens` is a multiple of it); order source
        # block, head, run.
        bb, hh, jj = np.meshgrid(src_blocks, h, np.arange(src.block_tokens // small), indexing="ij")
        tok = (bb * src.block_tokens + jj * small).ravel()
        keep = tok < tokens
        return tok[keep], hh.ravel()[keep], small * hb
    if src.order == dst.order == "NHD":
        # Units: one token's run of the shared heads; order token.
        return np.arange(tokens, dtype=np.int64), np.full(tokens, heads.first, dtype=np.int64), heads.count * hb
    # Orders differ: one head of one token; order source block, then the source's own order.
    slots = np.arange(src.block_tokens, dtype=np.int64)
    if src.order == "HND":
        bb, hh, kk = np.meshgrid(src_blocks, h, slots, indexing="ij")
    else:
        bb, kk, hh = np.meshgrid(src_blocks, slots, h, indexing="ij")
    tok = (bb * src.block_tokens + kk).ravel()
    keep = tok < tokens
    return tok[keep], hh.ravel()[keep], hb


def _merge(side: Side, token: I64, head: I64, unit: int) -> Segments:
    """This side's offsets of the units, region by region, touching ones merged into one
    segment (never across buffers). Worked on as ``[region, unit]``: the buffer is checked
    once per region, not per unit."""
    off = side.offsets(token, head)
    regions = side.regions
    starts = np.empty(off.shape, dtype=bool)
    np.not_equal(off[:, 1:], off[:, :-1] + unit, out=starts[:, 1:])
    starts[0, 0] = True
    starts[1:, 0] = (regions.buffer[1:] != regions.buffer[:-1]) | (off[1:, 0] != off[:-1, -1] + unit)
    first = np.flatnonzero(starts.ravel())
    lengths = np.diff(first, append=off.size) * unit
    return Segments(regions.buffer[first // off.shape[1]], off.ravel()[first], lengths)


def _span(heads: HeadRange) -> str:
    return f"{heads.first}..{heads.end - 1}"
