"""SGLang's KV, metadata and model-state buffers as kvxfer pools.

SGLang hands a transfer backend its memory as addresses (``KVArgs.kv_data_ptrs``, one K or V
buffer per layer, each ``kv_data_lens[i]`` bytes of pages of ``kv_item_lens[i]`` bytes; the
request metadata buffers, ``aux_data_ptrs``, one row per request slot; and a hybrid model's
state components, ``state_data_ptrs[c]``, rows of ``state_item_lens[c][i]`` bytes each). A
page of a layer is ``page_size`` tokens, each all the rank's KV heads (``NHD``), so every
buffer is one region of a kvxfer pool whose block is SGLang's page (or row): page ``p`` of
every layer is block ``p``.

>>> from kvxfer_client.sglang._memory import kv_layout
>>> model = ModelInfo(dtype="bfloat16", block_tokens=16, tp_size=2, tp_rank=1, kv_format=KV_FORMAT)
>>> layout = kv_layout([2048, 2048], [4352, 4352], model, total_heads=4)
>>> layout.num_blocks, layout.regions[1]
(2, Region(buffer_index=1, offset=0, block_stride=2048, block_bytes=2048))
>>> layout.geometry
KvGeometry(block_tokens=16, total_kv_heads=4, head_bytes=64, order='NHD')
>>> row_layout([960, 8192], [16320, 139264], ModelInfo(kv_format="sglang-state-mamba")).num_blocks
17
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.errors import IncompatibleError, InvalidRequestError
from kvxfer.geometry import KvGeometry, rank_heads
from kvxfer.layout import Layout, ModelInfo, Region

__all__ = ["KV_FORMAT", "host_views", "kv_layout", "row_layout"]

#: How SGLang lays a page out (tokens, then heads): part of the pools' fingerprint.
KV_FORMAT = "sglang-mha-nhd"


def host_views(ptrs: Sequence[int], lens: Sequence[int]) -> list[np.ndarray[Any, Any]]:
    """CPU buffers SGLang gave by address, as numpy views kvxfer can register (the engine's
    tensors stay alive as long as its pool does)."""
    if len(ptrs) != len(lens):
        raise InvalidRequestError(f"{len(ptrs)} buffer addresses, {len(lens)} lengths")
    return [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p)) for p, n in zip(ptrs, lens, strict=True)]


def kv_layout(item_lens: Sequence[int], data_lens: Sequence[int], model: ModelInfo, total_heads: int) -> Layout:
    """A pool of KV pages (``model``: its dtype, page tokens, the rank's tensor parallelism
    and the page format): one region per K or V buffer, a block per page. With equal pages in
    every buffer it declares the heads inside a page, so pools of other tensor parallelism
    exchange pages head by head."""
    regions, blocks = _regions(item_lens, data_lens)
    if len(set(item_lens)) != 1:  # a draft model's pages beside the target's: moved as they are
        return Layout(blocks, regions, model)
    page_size = model.block_tokens
    heads = rank_heads(total_heads, model.tp_size, model.tp_rank).count
    if item_lens[0] % (page_size * heads):
        raise IncompatibleError(f"a {item_lens[0]}-byte page is not {page_size} tokens of {heads} heads")
    geometry = KvGeometry(page_size, total_heads, item_lens[0] // (page_size * heads), "NHD")
    return Layout(blocks, regions, model, geometry)


def row_layout(item_lens: Sequence[int], data_lens: Sequence[int], model: ModelInfo) -> Layout:
    """A pool of rows moved as they are (the metadata rows, a model-state component): one
    region per buffer, a block per row. ``model.kv_format`` names what the rows hold and, for
    a rank's shard of a state, its tensor parallelism says whose: only such pools meet."""
    regions, blocks = _regions(item_lens, data_lens)
    return Layout(blocks, regions, model)


def _regions(item_lens: Sequence[int], data_lens: Sequence[int]) -> tuple[tuple[Region, ...], int]:
    if not item_lens or len(item_lens) != len(data_lens) or min(item_lens) <= 0:
        raise InvalidRequestError(f"buffers of {list(item_lens)}-byte items and {list(data_lens)} bytes")
    blocks = min(n // item for n, item in zip(data_lens, item_lens, strict=True))
    return tuple(Region(i, 0, item, item) for i, item in enumerate(item_lens)), blocks
