"""What a tier chunk is and what its keys mean: the canonical layout every pool's blocks are
kept in (heads-major, every head, for pools that declare a geometry), the namespace a pool's
keys live in (everything about the chunk's bytes, and the engine's salt), and the checks of
an engine's keys."""

from __future__ import annotations

import hashlib

import numpy as np

from kvxfer.errors import InvalidRequestError
from kvxfer.geometry import KvGeometry
from kvxfer.layout import Layout, ModelInfo, Region

__all__ = ["MAX_KEY_BYTES", "MAX_SALT_BYTES", "canonical", "check_keys", "namespace_name"]

MAX_KEY_BYTES = 64
MAX_SALT_BYTES = 64


def canonical(layout: Layout) -> Layout:
    """The layout of a tier chunk of ``layout``'s blocks (one block, regions back to back);
    for a pool that declares a geometry, every KV head, heads-major.

    >>> from kvxfer.layout import Layout, ModelInfo
    >>> from kvxfer.geometry import KvGeometry
    >>> rank = Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=16 * 2 * 128,
    ...     model=ModelInfo("m", "bf16", 16, tp_size=4, tp_rank=1), geometry=KvGeometry(16, 8, 128, "NHD"))
    >>> chunk = canonical(rank)
    >>> [r.block_bytes for r in chunk.regions], chunk.geometry.order, chunk.model.tp_size
    ([16384, 16384, 16384, 16384], 'HND', 1)
    """
    g = layout.geometry
    if g is None:
        sizes = [r.block_bytes for r in layout.regions]
        geometry = None
    else:
        sizes = [g.block_tokens * g.total_kv_heads * g.head_bytes] * len(layout.regions)
        geometry = KvGeometry(g.block_tokens, g.total_kv_heads, g.head_bytes, "HND")
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    regions = tuple(Region(0, int(o), sum(sizes), n) for o, n in zip(offsets, sizes, strict=True))
    m = layout.model
    model = ModelInfo(m.model, m.dtype, m.block_tokens, 1, 0, m.kv_format) if g is not None else m
    return Layout(1, regions, model, geometry)


def namespace_name(pool_layout: Layout, chunk: Layout, salt: bytes) -> tuple[str, str]:
    """What keys mean: everything about a chunk's bytes, and the engine's salt. Pools without
    a geometry add their whole signature (TP rank included): their blocks are kept as they are."""
    described = chunk.model.to_proto().SerializeToString(deterministic=True)
    parts = [described, repr([r.block_bytes for r in chunk.regions]).encode()]
    if chunk.geometry is not None:
        parts.append(chunk.geometry.to_proto().SerializeToString(deterministic=True))
    else:
        parts.append(pool_layout.signature().SerializeToString(deterministic=True))
    digest = hashlib.sha256(b"\0".join([*parts, salt])).hexdigest()[:16]
    m = chunk.model
    return digest, f"{m.model or '?'} {m.dtype or '?'} x{m.block_tokens or '?'}"


def check_keys(keys: list[bytes], salt: bytes, blocks: int) -> None:
    """An engine's keys and salt: one key per block, each 1..64 bytes, no key twice."""
    if len(keys) != blocks:
        raise InvalidRequestError(f"{len(keys)} keys for {blocks} blocks: one key per block")
    if len(salt) > MAX_SALT_BYTES:
        raise InvalidRequestError(f"salt longer than {MAX_SALT_BYTES} bytes")
    if any(not 0 < len(k) <= MAX_KEY_BYTES for k in keys):
        raise InvalidRequestError(f"each key must be 1..{MAX_KEY_BYTES} bytes")
    if len(set(keys)) != len(keys):
        raise InvalidRequestError("a key appears twice in one call")
