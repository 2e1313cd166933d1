"""The local path's launch on a real GPU: tables go through the pinned ring and every launch
copies exactly its own blocks, also once the ring has wrapped around many times."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.dataplane.plan import RegionTable

pytestmark = pytest.mark.gpu


def test_launches_through_the_table_ring_copy_exactly_their_blocks_after_wrapping() -> None:
    cupy = pytest.importorskip("cupy")
    from kvxferd.dataplane.gpu_kernel import BlockSide
    from kvxferd.dataplane.gpucopy import GpuCopier

    blocks, seg = 64, 4096 + 48  # a segment size that is not a multiple of 16
    regions = RegionTable.from_regions([(0, 0, seg, seg), (0, blocks * seg, seg, seg)])
    src = cupy.random.randint(0, 256, 2 * blocks * seg, dtype=cupy.uint8)
    dst = cupy.zeros_like(src)
    cupy.cuda.Device().synchronize()
    base_s = np.array([src.data.ptr], dtype=np.int64)
    base_d = np.array([dst.data.ptr], dtype=np.int64)
    copier = GpuCopier(0)
    rng = np.random.default_rng(3)
    expected = np.zeros(2 * blocks * seg, dtype=np.uint8)
    host_src = cupy.asnumpy(src)
    launches = []
    for _ in range(3 * 64 + 5):  # the ring has 64 slots: wrap it three times
        n = int(rng.integers(1, 9))
        ids_s = rng.permutation(blocks)[:n]
        ids_d = rng.permutation(blocks)[:n]
        launches.append(
            copier.launch_blocks(BlockSide.of(0, base_s, regions, ids_s), BlockSide.of(0, base_d, regions, ids_d))
        )
        for r in range(2):
            for a, b in zip(ids_s, ids_d, strict=True):
                o = r * blocks * seg
                expected[o + b * seg : o + (b + 1) * seg] = host_src[o + a * seg : o + (a + 1) * seg]
    launches[-1].done.synchronize()
    assert np.array_equal(cupy.asnumpy(dst), expected)
    assert all(launch.device_s() > 0 for launch in launches)
