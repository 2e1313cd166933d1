"""Layouts read off KV tensors of the shapes serving engines use: every region's segment of
block b is exactly the bytes of that block in the tensor."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvxfer_client import InvalidRequestError, layout_from_tensors
from kvxfer_client._host_tensor import host_tensor_extent

BLOCKS, TOKENS, HEADS, HEAD_DIM = 12, 16, 2, 32

SHAPES = {
    # name: (per-layer shape, block dim, how to take block b out of the tensor)
    "flash [2, B, T, H, D]": ((2, BLOCKS, TOKENS, HEADS, HEAD_DIM), 1, lambda t, b: t[:, b]),
    "flashinfer [B, 2, T, H, D]": ((BLOCKS, 2, TOKENS, HEADS, HEAD_DIM), 0, lambda t, b: t[b]),
    "cpu backend [B, H, T, 2D]": ((BLOCKS, HEADS, TOKENS, 2 * HEAD_DIM), 0, lambda t, b: t[b]),
    "mla [B, T, latent]": ((BLOCKS, TOKENS, 576), 0, lambda t, b: t[b]),
}


def _bytes_of_block(layout: Any, raw: list[np.ndarray], b: int) -> bytes:
    return b"".join(
        raw[r.buffer_index][r.offset + b * r.block_stride :][: r.block_bytes].tobytes() for r in layout.regions
    )


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_each_blocks_segments_are_that_blocks_bytes(name: str, lib: str) -> None:
    shape, block_dim, take = SHAPES[name]
    if lib == "torch":  # bfloat16: read through DLPack, as vLLM's tensors are
        tensors: list[Any] = [torch.randn(shape).to(torch.bfloat16) for _ in range(3)]
        raw = [t.view(torch.uint8).numpy().reshape(-1) for t in tensors]
        block = lambda t, b: take(t, b).contiguous().view(torch.uint8).numpy().tobytes()  # noqa: E731
    else:
        tensors = [np.random.default_rng(i).standard_normal(shape).astype(np.float16) for i in range(3)]
        raw = [t.view(np.uint8).reshape(-1) for t in tensors]
        block = lambda t, b: np.ascontiguousarray(take(t, b)).tobytes()  # noqa: E731
    layout = layout_from_tensors(tensors, block_dim=block_dim)
    assert layout.num_blocks == BLOCKS
    layout.validate([host_tensor_extent(t)[1] for t in tensors])
    for b in (0, 5, BLOCKS - 1):
        expected = b"".join(block(t, b) for t in tensors)
        assert _bytes_of_block(layout, raw, b) == expected


def test_what_cannot_be_a_layout_is_refused_clearly() -> None:
    a = np.zeros((2, 8, 4, 4), dtype=np.float16)
    with pytest.raises(InvalidRequestError, match="tensor 1 has 9 blocks"):
        layout_from_tensors([a, np.zeros((2, 9, 4, 4), dtype=np.float16)], block_dim=1)
    with pytest.raises(InvalidRequestError, match="inside a block are not contiguous"):
        layout_from_tensors([np.zeros((8, 4, 4), dtype=np.float16).transpose(0, 2, 1)], block_dim=0)
    with pytest.raises(InvalidRequestError, match="block_dim 4 is not one"):
        layout_from_tensors([a], block_dim=4)
    with pytest.raises(InvalidRequestError, match="no shape"):
        layout_from_tensors([object()], block_dim=0)
