"""Registered pools: the engines' buffers, mapped into the daemon, with their layouts.

Every byte the data plane touches is derived from (pool, region, block id); block ids are
checked against ``num_blocks`` here and the layout was checked against the mapped buffer
sizes at registration, so no offset a plan computes can leave its buffer.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxfer_client._errors import InvalidRequestError, NotFoundError
from kvxfer_client._layout import Layout
from kvxfer_client._memory import HostBuffer
from kvxfer_client._proto import common_pb2

from ..dataplane.plan import RegionTable

__all__ = ["Pool", "PoolRegistry", "check_block_ids"]

U8 = npt.NDArray[np.uint8]
MAX_BUFFERS = 4096


@dataclass
class Pool:
    pool_id: str
    name: str
    session_id: str
    layout: Layout
    kind: int
    mappings: list[HostBuffer]
    arrays: list[U8]
    regions: RegionTable
    fingerprint: str
    offers: set[str] = field(default_factory=set)
    #: Transfers currently reading or writing this pool's memory.
    busy: int = 0
    #: Deregistered: unmapped when ``busy`` drops to 0.
    closing: bool = False

    @property
    def nbytes(self) -> int:
        return sum(m.size for m in self.mappings)

    def close(self) -> None:
        self.arrays.clear()
        for m in self.mappings:
            m.close()
        self.mappings.clear()


def check_block_ids(ids: Sequence[int], num_blocks: int, what: str) -> npt.NDArray[np.int64]:
    """Validate block ids (non-empty, in range, no repeats) as one vectorised pass."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size == 0:
        raise InvalidRequestError(f"{what}: empty block list")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise InvalidRequestError(f"{what}: block id {bad} outside the pool's 0..{num_blocks - 1}")
    if np.unique(arr).size != arr.size:
        raise InvalidRequestError(f"{what}: block ids repeat")
    return arr


class PoolRegistry:
    def __init__(self) -> None:
        self.pools: dict[str, Pool] = {}

    def register(
        self, session_id: str, buffers: Sequence[common_pb2.BufferSpec], layout_msg: common_pb2.Layout, name: str
    ) -> Pool:
        if not buffers or len(buffers) > MAX_BUFFERS:
            raise InvalidRequestError(f"a pool needs 1..{MAX_BUFFERS} buffers")
        if len(name) > 256:
            raise InvalidRequestError("pool name longer than 256 characters")
        layout = Layout.from_proto(layout_msg)
        layout.validate([b.size for b in buffers])
        kinds = {b.kind for b in buffers}
        if kinds != {common_pb2.MEMORY_KIND_HOST_SHM}:
            raise InvalidRequestError(
                "only HOST_SHM buffers are supported by this daemon build (CUDA_IPC needs the GPU build)"
            )
        mappings: list[HostBuffer] = []
        try:
            for spec in buffers:
                mappings.append(HostBuffer.attach(spec.shm_name, spec.size))
        except BaseException:
            for m in mappings:
                m.close()
            raise
        regions = RegionTable.from_regions(
            (r.buffer_index, r.offset, r.block_stride, r.block_bytes) for r in layout.regions
        )
        pool = Pool(
            pool_id="pool-" + secrets.token_hex(6),
            name=name,
            session_id=session_id,
            layout=layout,
            kind=common_pb2.MEMORY_KIND_HOST_SHM,
            mappings=mappings,
            arrays=[m.array() for m in mappings],
            regions=regions,
            fingerprint=layout.fingerprint(),
        )
        self.pools[pool.pool_id] = pool
        return pool

    def get(self, pool_id: str) -> Pool:
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFoundError(f"no pool {pool_id!r} on this daemon")
        return pool

    def remove(self, pool_id: str) -> Pool:
        pool = self.get(pool_id)
        del self.pools[pool_id]
        return pool

    @property
    def registered_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())
