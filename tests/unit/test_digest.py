"""The sampled digest reads a few bounded windows spread over an offer, whatever its layout."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd._digest import SAMPLE_WINDOW, sample_offer
from kvxferd.dataplane.checksum import segment_sums
from kvxferd.dataplane.hostmem import MappedMemory
from kvxferd.dataplane.plan import RegionTable

MIB = 1 << 20
SHAPES = {
    "contig": (1, [128 * MIB, 128 * MIB]),  # one contiguous K and V
    "b16": (128, [32 << 10] * 64),  # Llama-3-8B, 16-token blocks
    "b128": (16, [256 << 10] * 64),
    "small": (1, [2 << 10, 2 << 10]),
    "mixed": (7, [3 << 20, 40, 1 << 10]),  # sizes no window divides
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("samples", [1, 8, 64])
def test_each_window_holds_a_byte_of_its_own_stratum_and_lies_inside_its_segment(shape: str, samples: int) -> None:
    blocks, sizes = SHAPES[shape]
    nbytes = np.array(sizes, dtype=np.int64)
    rng = np.random.default_rng(5)
    per_block, total = int(nbytes.sum()), blocks * int(nbytes.sum())
    seg_start = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
    for _ in range(20):
        positions, regions, within = sample_offer(rng, blocks, nbytes, samples)
        if within is None:  # a small offer: every segment whole
            assert blocks * len(sizes) <= samples and max(sizes) <= SAMPLE_WINDOW
            assert sorted(zip(positions.tolist(), regions.tolist(), strict=True)) == [
                (b, r) for b in range(blocks) for r in range(len(sizes))
            ]
            continue
        starts, lengths = within
        assert len(positions) <= samples and lengths.sum() <= samples * SAMPLE_WINDOW
        assert (lengths == np.minimum(nbytes[regions], SAMPLE_WINDOW)).all()
        assert ((starts >= 0) & (starts + lengths <= nbytes[regions]) & (starts % 8 == 0)).all()
        at = positions * per_block + seg_start[regions] + starts  # where each window begins in the offer
        assert (np.diff(at) > 0).all(), "kept once each, in offer order"
        if nbytes.max() <= SAMPLE_WINDOW:
            continue  # windows are whole segments, possibly fewer than the strata
        # Window i holds the byte picked in stratum i (it may begin before it, cut to its segment).
        k = np.arange(samples)
        lo, hi = k * total // samples, (k + 1) * total // samples
        assert len(at) == samples and ((at < hi) & (at + lengths > lo)).all(), "one window per stratum"


def test_windows_cover_every_part_of_a_large_segment_alike() -> None:
    """Over many offers, windows start everywhere in two 128 MiB segments (not at their heads)."""
    rng = np.random.default_rng(9)
    nbytes = np.array([128 * MIB, 128 * MIB], dtype=np.int64)
    firsts = np.concatenate([sample_offer(rng, 1, nbytes, 8)[2][0] for _ in range(200)])  # type: ignore[index]
    tenths = np.bincount(firsts * 10 // (128 * MIB), minlength=10)
    assert tenths.min() >= 0.5 * tenths.mean(), tenths


def test_a_change_inside_a_sampled_window_changes_its_sum_and_none_other() -> None:
    buf = np.random.default_rng(3).integers(0, 256, 8 * MIB, dtype=np.uint8)
    regions = RegionTable.from_regions([(0, 0, 4 * MIB, 2 * MIB), (0, 2 * MIB, 4 * MIB, 2 * MIB)])
    positions, region_of, within = sample_offer(np.random.default_rng(2), 2, regions.nbytes, 8)
    assert within is not None
    memory = MappedMemory([buf])
    before = segment_sums(memory, regions, positions, region_of, within)
    j = 3
    byte = int(regions.offset[region_of[j]] + positions[j] * 4 * MIB + within[0][j] + within[1][j] // 2)
    buf[byte] ^= 0x10
    assert (segment_sums(memory, regions, positions, region_of, within) != before).tolist() == [
        i == j for i in range(len(positions))
    ]
