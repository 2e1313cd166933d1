"""A model's KV as tensor-parallel ranks hold it, in any geometry: the reference the remap tests
and the sliced benchmarks check against.

The model's KV is one logical array ``[layers, K/V, tokens, heads, head_bytes]``. A rank's pool
holds its heads in per-layer buffers ``[2, POOL_BLOCKS, inner]`` (``Layout.paged_kv``), each
block heads-major (``[heads, block_tokens, head_bytes]``, HND) or tokens-major (NHD).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from kvxfer.geometry import HeadRange
from kvxfer_client import KvGeometry, Layout, ModelInfo
from kvxferd.dataplane.plan import RegionTable
from kvxferd.dataplane.remap import Side

from .cluster import Cluster, Daemon, EngineProcess

__all__ = ["HEAD_BYTES", "LAYERS", "POOL_BLOCKS", "Pool", "engine_with", "logical_kv", "pool_bytes"]

LAYERS, HEAD_BYTES, POOL_BLOCKS = 3, 8, 24


@dataclass
class Pool:
    """One rank's pool: per-layer ``[2, POOL_BLOCKS, inner]`` tensors, flat as the daemon sees them."""

    heads: HeadRange
    block_tokens: int
    order: str
    buffers: list[np.ndarray]

    @classmethod
    def empty(cls, heads: HeadRange, block_tokens: int, order: str) -> Pool:
        size = 2 * POOL_BLOCKS * block_tokens * heads.count * HEAD_BYTES
        return cls(heads, block_tokens, order, [np.zeros(size, dtype=np.uint8) for _ in range(LAYERS)])

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.heads.count * HEAD_BYTES

    def regions(self) -> RegionTable:
        bb = self.block_bytes
        return RegionTable.from_regions(
            [(layer, kv * POOL_BLOCKS * bb, bb, bb) for layer in range(LAYERS) for kv in (0, 1)]
        )

    def blocks(self, layer: int) -> np.ndarray:
        """``[2, blocks, heads, block_tokens, head_bytes]`` (HND view, whatever the order)."""
        shape = (2, POOL_BLOCKS, self.block_tokens, self.heads.count, HEAD_BYTES)
        if self.order == "HND":
            return self.buffers[layer].reshape(2, POOL_BLOCKS, self.heads.count, self.block_tokens, HEAD_BYTES)
        return self.buffers[layer].reshape(shape).transpose(0, 1, 3, 2, 4)

    def fill(self, logical: np.ndarray, ids: list[int]) -> None:
        """Write the request's tokens (logical ``[L, 2, T, K, hb]``) into blocks ``ids``."""
        for layer in range(LAYERS):
            view = self.blocks(layer)
            for i, b in enumerate(ids):
                tokens = logical[
                    layer, :, i * self.block_tokens : (i + 1) * self.block_tokens, self.heads.first : self.heads.end
                ]
                view[:, b, :, : tokens.shape[1]] = tokens.transpose(0, 2, 1, 3)

    def expected(self, logical: np.ndarray, ids: list[int], heads: HeadRange, tokens: int) -> list[np.ndarray]:
        """This (empty) pool after receiving ``heads`` of the first ``tokens`` tokens in ``ids``."""
        out = Pool.empty(self.heads, self.block_tokens, self.order)
        for layer in range(LAYERS):
            view = out.blocks(layer)
            for i, b in enumerate(ids):
                lo, hi = i * self.block_tokens, min((i + 1) * self.block_tokens, tokens)
                if hi <= lo:
                    continue
                part = logical[layer, :, lo:hi, heads.first : heads.end].transpose(0, 2, 1, 3)
                h0 = heads.first - self.heads.first
                view[:, b, h0 : h0 + heads.count, : hi - lo] = part
        return out.buffers

    def layout(self, total_kv_heads: int, tp_size: int, tp_rank: int) -> Layout:
        """The pool's layout, with its geometry declared (what an engine registers)."""
        return Layout.paged_kv(
            num_layers=LAYERS,
            num_blocks=POOL_BLOCKS,
            block_bytes=self.block_bytes,
            model=ModelInfo("ref-model", "u8", self.block_tokens, tp_size, tp_rank),
            geometry=KvGeometry(self.block_tokens, total_kv_heads, HEAD_BYTES, self.order),  # type: ignore[arg-type]
        )

    def side(self, ids: list[int]) -> Side:
        return Side(self.regions(), np.array(ids), self.block_tokens, self.heads, HEAD_BYTES, self.order)  # type: ignore[arg-type]


def logical_kv(heads: int, tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, (LAYERS, 2, tokens, heads, HEAD_BYTES), dtype=np.uint8)


def engine_with(
    cluster: Cluster, daemon: Daemon, name: str, pool: Pool, heads: int, tp: int, rank: int
) -> EngineProcess:
    """An engine process on ``daemon`` with ``pool`` (its bytes included) registered as TP rank
    ``rank`` of ``tp`` over ``heads`` KV heads."""
    engine = cluster.engine(daemon, name)
    layout = pool.layout(heads, tp, rank)
    engine(
        "pool",
        shape={"layers": LAYERS, "blocks": POOL_BLOCKS, "block_bytes": pool.block_bytes},
        model={
            "model": layout.model.model,
            "dtype": "u8",
            "block_tokens": pool.block_tokens,
            "tp_size": tp,
            "tp_rank": rank,
        },
        geometry={
            "block_tokens": pool.block_tokens,
            "total_kv_heads": heads,
            "head_bytes": HEAD_BYTES,
            "order": pool.order,
        },
        data=[base64.b64encode(b.tobytes()).decode() for b in pool.buffers],
    )
    return engine


def pool_bytes(engine: EngineProcess) -> list[np.ndarray]:
    """The engine's pool buffers as they are now."""
    return [np.frombuffer(base64.b64decode(b), dtype=np.uint8) for b in engine("dump")["buffers"]]
