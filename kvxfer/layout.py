"""Pool layouts: which bytes make up block *b* of a pool.

A pool is one or more buffers plus a :class:`Layout`. Block ``b`` has one segment per
:class:`Region`, at ``buffer[region.buffer_index] + region.offset + b * region.block_stride``,
``region.block_bytes`` long. Two pools can exchange blocks when their layouts have the same
fingerprint: the same per-region segment sizes and the same model facts.

>>> layout = Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=4096)
>>> len(layout.regions), layout.bytes_per_block, layout.buffer_sizes()
(4, 16384, [65536, 65536])
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import InvalidRequestError
from .geometry import KvGeometry, rank_heads
from .proto import common_pb2

__all__ = ["MAX_BLOCKS", "MAX_REGIONS", "Layout", "ModelInfo", "Region", "mapping_between"]

#: Upper bound on ``Layout.num_blocks`` (block ids travel as uint32).
MAX_BLOCKS = 1 << 24
#: Upper bound on the number of regions of one layout.
MAX_REGIONS = 8192


@dataclass(frozen=True)
class Region:
    """One segment of every block: where block 0's segment starts, the step, the size."""

    buffer_index: int
    offset: int
    block_stride: int
    block_bytes: int

    def end(self, num_blocks: int) -> int:
        """First byte after the last block's segment."""
        return self.offset + (num_blocks - 1) * self.block_stride + self.block_bytes


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the KV cache both ends of a transfer must agree on."""

    model: str = ""
    dtype: str = ""
    block_tokens: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    #: How KV lies inside a block as the engine's kernels read it (common.proto, ModelInfo):
    #: part of the fingerprint, so engines that lay blocks out differently never meet.
    kv_format: str = ""

    def to_proto(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(
            model=self.model,
            dtype=self.dtype,
            block_tokens=self.block_tokens,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            kv_format=self.kv_format,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.ModelInfo) -> ModelInfo:
        return cls(msg.model, msg.dtype, msg.block_tokens, msg.tp_size, msg.tp_rank, msg.kv_format)


@dataclass(frozen=True)
class Layout:
    """How the blocks of a pool map onto its buffers."""

    num_blocks: int
    regions: tuple[Region, ...]
    model: ModelInfo = field(default_factory=ModelInfo)
    #: What is inside each block (heads, order, tokens), when declared: then pools of other
    #: TP, head order or block size can exchange blocks with this one (see ``_geometry``).
    geometry: KvGeometry | None = None

    @classmethod
    def paged_kv(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_bytes: int,
        model: ModelInfo | None = None,
        geometry: KvGeometry | None = None,
    ) -> Layout:
        """The layout of one ``[2, num_blocks, ...]`` tensor per layer (K then V), one buffer
        per layer: ``2 * num_layers`` regions of ``block_bytes`` each.
        """
        regions = []
        for layer in range(num_layers):
            for kv in range(2):
                regions.append(Region(layer, kv * num_blocks * block_bytes, block_bytes, block_bytes))
        return cls(num_blocks, tuple(regions), model or ModelInfo(), geometry)

    @classmethod
    def contiguous(cls, *, num_blocks: int, block_bytes: int, model: ModelInfo | None = None) -> Layout:
        """One buffer, one region: each block is one contiguous ``block_bytes`` range."""
        return cls(num_blocks, (Region(0, 0, block_bytes, block_bytes),), model or ModelInfo())

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all regions."""
        return sum(r.block_bytes for r in self.regions)

    @property
    def num_buffers(self) -> int:
        return max((r.buffer_index for r in self.regions), default=-1) + 1

    def buffer_sizes(self) -> list[int]:
        """The smallest size of each buffer that holds every segment of the layout."""
        sizes = [0] * self.num_buffers
        for r in self.regions:
            sizes[r.buffer_index] = max(sizes[r.buffer_index], r.end(self.num_blocks))
        return sizes

    def validate(self, buffer_sizes: Sequence[int]) -> None:
        """Raise :class:`InvalidRequestError` unless every segment lies inside its buffer.

        >>> Layout.contiguous(num_blocks=4, block_bytes=10).validate([39])
        Traceback (most recent call last):
        ...
        kvxfer_client.InvalidRequestError: region 0 ends at byte 40 but buffer 0 has 39 bytes
        """
        if not 1 <= self.num_blocks <= MAX_BLOCKS:
            raise InvalidRequestError(f"num_blocks must be in 1..{MAX_BLOCKS}, got {self.num_blocks}")
        if not 1 <= len(self.regions) <= MAX_REGIONS:
            raise InvalidRequestError(f"a layout needs 1..{MAX_REGIONS} regions, got {len(self.regions)}")
        for i, r in enumerate(self.regions):
            if not 0 <= r.buffer_index < len(buffer_sizes):
                raise InvalidRequestError(
                    f"region {i} names buffer {r.buffer_index} but the pool has {len(buffer_sizes)}"
                )
            if r.block_bytes <= 0 or r.offset < 0:
                raise InvalidRequestError(f"region {i}: block_bytes must be > 0 and offset >= 0")
            if self.num_blocks > 1 and r.block_stride < r.block_bytes:
                raise InvalidRequestError(
                    f"region {i}: block_stride {r.block_stride} < block_bytes {r.block_bytes} would make blocks overlap"
                )
            if self.geometry is not None:
                self.geometry.check(max(1, self.model.tp_size), self.model.tp_rank, r.block_bytes)
            end = r.end(self.num_blocks)
            if end > buffer_sizes[r.buffer_index]:
                raise InvalidRequestError(
                    f"region {i} ends at byte {end} but buffer {r.buffer_index} "
                    f"has {buffer_sizes[r.buffer_index]} bytes"
                )

    def signature(self) -> common_pb2.LayoutSignature:
        """What a peer's layout must match, field by field. Built once per layout (every
        handoff of a pool asks for it): callers read it and never change it.

        >>> layout = Layout.paged_kv(num_layers=1, num_blocks=4, block_bytes=64)
        >>> layout.signature() is layout.signature(), list(layout.signature().block_bytes)
        (True, [64, 64])
        """
        signature: common_pb2.LayoutSignature | None = self.__dict__.get("_signature")
        if signature is None:
            signature = common_pb2.LayoutSignature(
                block_bytes=[r.block_bytes for r in self.regions],
                model=self.model.to_proto(),
                geometry=self.geometry.to_proto() if self.geometry else None,
            )
            object.__setattr__(self, "_signature", signature)  # frozen: a cache, not a field
        return signature

    def fingerprint(self) -> str:
        """Short hash of :meth:`signature`: equal fingerprints mean compatible layouts."""
        return signature_fingerprint(self.signature())

    def to_proto(self) -> common_pb2.Layout:
        return common_pb2.Layout(
            num_blocks=self.num_blocks,
            regions=[
                common_pb2.Region(
                    buffer_index=r.buffer_index,
                    offset=r.offset,
                    block_stride=r.block_stride,
                    block_bytes=r.block_bytes,
                )
                for r in self.regions
            ],
            model=self.model.to_proto(),
            geometry=self.geometry.to_proto() if self.geometry else None,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.Layout) -> Layout:
        regions = tuple(Region(r.buffer_index, r.offset, r.block_stride, r.block_bytes) for r in msg.regions)
        return cls(msg.num_blocks, regions, ModelInfo.from_proto(msg.model), KvGeometry.from_proto(msg.geometry))


def signature_fingerprint(sig: common_pb2.LayoutSignature) -> str:
    """Hash a layout signature into the fingerprint carried by tickets. With a geometry, only
    what no mapping changes counts (pools of other TP, head order or block size share it)."""
    m, g = sig.model, KvGeometry.from_proto(sig.geometry)
    if g is None:
        facts: list[object] = [list(sig.block_bytes), [m.model, m.dtype, m.block_tokens, m.tp_size, m.tp_rank]]
    else:
        facts = ["mappable", len(sig.block_bytes), [m.model, m.dtype], [g.total_kv_heads, g.head_bytes]]
    if m.kv_format:  # added only when given: fingerprints of pools without one stay as they were
        facts.append(["kv_format", m.kv_format])
    canonical = json.dumps(facts, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def signature_mismatch(ours: common_pb2.LayoutSignature, theirs: common_pb2.LayoutSignature) -> str | None:
    """Name the first difference between two signatures that no mapping bridges, or return
    None when blocks can move between them (see :func:`mapping_between` for how)."""
    if ours == theirs:  # the rule on every pull between like pools: one comparison in C
        return None
    a, b = KvGeometry.from_proto(ours.geometry), KvGeometry.from_proto(theirs.geometry)
    if a is not None and b is not None:
        return _geometry_mismatch(ours, theirs, a, b)
    if list(ours.block_bytes) != list(theirs.block_bytes):
        if len(ours.block_bytes) != len(theirs.block_bytes):
            return f"region count differs: {len(ours.block_bytes)} vs {len(theirs.block_bytes)}"
        for i, (x, y) in enumerate(zip(ours.block_bytes, theirs.block_bytes, strict=True)):
            if x != y:
                return f"region {i} block_bytes differs: {x} vs {y}"
    for name in ("model", "dtype", "block_tokens", "tp_size", "tp_rank"):
        x, y = getattr(ours.model, name), getattr(theirs.model, name)
        if x != y:
            return f"model {name} differs: {x!r} vs {y!r}"
    return _kv_format_mismatch(ours, theirs)


def _kv_format_mismatch(ours: common_pb2.LayoutSignature, theirs: common_pb2.LayoutSignature) -> str | None:
    """The in-block layouts differ: the same bytes would be read as other values.

    >>> def sig(kv_format):
    ...     return common_pb2.LayoutSignature(model=common_pb2.ModelInfo(kv_format=kv_format))
    >>> print(_kv_format_mismatch(sig("vllm/A [B,2,16,256] x2"), sig("vllm/B [B,16,2,256] x2")))
    KV format differs: 'vllm/A [B,2,16,256] x2' vs 'vllm/B [B,16,2,256] x2' (other engine versions or kernels)
    """
    x, y = ours.model.kv_format, theirs.model.kv_format
    if x != y:
        return f"KV format differs: {x!r} vs {y!r} (other engine versions or kernels)"
    return None


def _geometry_mismatch(
    ours: common_pb2.LayoutSignature, theirs: common_pb2.LayoutSignature, a: KvGeometry, b: KvGeometry
) -> str | None:
    if len(ours.block_bytes) != len(theirs.block_bytes):
        return f"region count (layers x K/V) differs: {len(ours.block_bytes)} vs {len(theirs.block_bytes)}"
    for name in ("model", "dtype"):
        x, y = getattr(ours.model, name), getattr(theirs.model, name)
        if x != y:
            return f"model {name} differs: {x!r} vs {y!r}"
    if a.total_kv_heads != b.total_kv_heads:
        return f"KV heads differ: {a.total_kv_heads} vs {b.total_kv_heads}"
    if ours.model.kv_format != theirs.model.kv_format:
        return _kv_format_mismatch(ours, theirs)
    if a.head_bytes != b.head_bytes:
        return f"bytes per head and token differ: {a.head_bytes} vs {b.head_bytes}"
    small, large = sorted((a.block_tokens, b.block_tokens))
    if large % small:
        return f"block sizes {a.block_tokens} and {b.block_tokens} tokens: one must divide the other"
    src_heads = rank_heads(a.total_kv_heads, max(1, ours.model.tp_size), ours.model.tp_rank)
    dst_heads = rank_heads(b.total_kv_heads, max(1, theirs.model.tp_size), theirs.model.tp_rank)
    if src_heads.overlap(dst_heads) is None:
        return (
            f"no KV head in common: TP rank {ours.model.tp_rank} of {ours.model.tp_size} holds heads "
            f"{src_heads.first}..{src_heads.end - 1}, rank {theirs.model.tp_rank} of {theirs.model.tp_size} "
            f"{dst_heads.first}..{dst_heads.end - 1}"
        )
    return None


def mapping_between(src: common_pb2.LayoutSignature, dst: common_pb2.LayoutSignature) -> str:
    """How blocks are remapped from ``src`` to ``dst`` ("" when they move as they are): what a
    pull result names.

    >>> from kvxfer.geometry import KvGeometry
    >>> def sig(tp, rank, order, block):
    ...     g = KvGeometry(block, total_kv_heads=8, head_bytes=256, order=order)
    ...     return Layout.paged_kv(num_layers=1, num_blocks=4, block_bytes=block * 8 // tp * 256,
    ...                            model=ModelInfo("m", "bf16", block, tp, rank), geometry=g).signature()
    >>> mapping_between(sig(1, 0, "NHD", 16), sig(2, 1, "HND", 32))
    'TP 1->2 (heads 4..7), NHD->HND, block 16->32 tokens'
    >>> mapping_between(sig(1, 0, "HND", 16), sig(1, 0, "HND", 16))
    ''
    """
    if src == dst:
        return ""
    a, b = KvGeometry.from_proto(src.geometry), KvGeometry.from_proto(dst.geometry)
    if a is None or b is None:
        return ""
    parts = []
    if (src.model.tp_size, src.model.tp_rank) != (dst.model.tp_size, dst.model.tp_rank):
        heads = rank_heads(a.total_kv_heads, max(1, src.model.tp_size), src.model.tp_rank).overlap(
            rank_heads(b.total_kv_heads, max(1, dst.model.tp_size), dst.model.tp_rank)
        )
        span = f"heads {heads.first}..{heads.end - 1}" if heads else "no heads"
        parts.append(f"TP {max(1, src.model.tp_size)}->{max(1, dst.model.tp_size)} ({span})")
    if a.order != b.order:
        parts.append(f"{a.order}->{b.order}")
    if a.block_tokens != b.block_tokens:
        parts.append(f"block {a.block_tokens}->{b.block_tokens} tokens")
    return ", ".join(parts)
