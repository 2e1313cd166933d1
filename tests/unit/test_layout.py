"""Layouts: bounds, fingerprints, mismatch messages."""

from __future__ import annotations

import pytest

from kvxfer.layout import signature_mismatch
from kvxfer_client import InvalidRequestError, Layout, ModelInfo, Region


def test_paged_kv_has_k_and_v_region_per_layer() -> None:
    layout = Layout.paged_kv(num_layers=3, num_blocks=10, block_bytes=100)
    assert len(layout.regions) == 6
    assert layout.regions[1] == Region(buffer_index=0, offset=1000, block_stride=100, block_bytes=100)
    assert layout.buffer_sizes() == [2000, 2000, 2000]
    layout.validate(layout.buffer_sizes())


@pytest.mark.parametrize(
    ("layout", "sizes", "message"),
    [
        (Layout.contiguous(num_blocks=4, block_bytes=10), [39], "ends at byte 40"),
        (Layout(4, (Region(1, 0, 10, 10),)), [100], "names buffer 1"),
        (Layout(4, (Region(0, 0, 5, 10),)), [100], "would make blocks overlap"),
        (Layout(0, (Region(0, 0, 10, 10),)), [100], "num_blocks"),
        (Layout(4, ()), [100], "regions"),
        (Layout(4, (Region(0, 0, 10, 0),)), [100], "block_bytes must be > 0"),
    ],
)
def test_validate_rejects_layouts_outside_their_buffers(layout: Layout, sizes: list[int], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        layout.validate(sizes)


def test_fingerprint_depends_on_segment_sizes_and_model_not_on_placement() -> None:
    a = Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=64)
    moved = Layout(16, tuple(Region(r.buffer_index, r.offset * 2, r.block_stride, r.block_bytes) for r in a.regions))
    assert a.fingerprint() == moved.fingerprint()
    assert a.fingerprint() != Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=32).fingerprint()
    other_model = Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=64, model=ModelInfo(dtype="fp8"))
    assert a.fingerprint() != other_model.fingerprint()


def test_signature_mismatch_names_the_difference() -> None:
    a = Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=64).signature()
    b = Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=32).signature()
    c = Layout.paged_kv(num_layers=3, num_blocks=8, block_bytes=64).signature()
    d = Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=64, model=ModelInfo(tp_size=2)).signature()
    assert signature_mismatch(a, a) is None
    assert signature_mismatch(a, b) == "region 0 block_bytes differs: 64 vs 32"
    assert signature_mismatch(a, c) == "region count differs: 4 vs 6"
    assert signature_mismatch(a, d) == "model tp_size differs: 1 vs 2"


def test_proto_round_trip() -> None:
    layout = Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=64, model=ModelInfo("m", "bf16", 16, 2, 1))
    assert Layout.from_proto(layout.to_proto()) == layout
