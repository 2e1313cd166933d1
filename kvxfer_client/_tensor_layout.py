"""A pool's :class:`~kvxfer_client.Layout` read off the engine's own KV tensors.

Serving engines keep one KV tensor per layer whose shape depends on the attention backend:
``[2, num_blocks, block_size, kv_heads, head_dim]`` (K and V planes, then blocks),
``[num_blocks, 2, ...]`` or ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (a block is
one run), ``[num_blocks, block_size, latent_dim]`` (MLA). All of them are a *block dimension*
with some dimensions outside it and a contiguous run inside it. Each combination of the outer
indices is one region: ``[2, num_blocks, ...]`` gives two regions per layer (K, V), a
block-outermost tensor one. Offsets and strides come from the tensor's own strides, so views
into a larger allocation work as long as each block's interior is contiguous.

Shapes and strides are read through ``__array_interface__``, ``__cuda_array_interface__`` or
DLPack: numpy, torch (CPU and CUDA) and CuPy tensors, without importing any of them.

>>> import numpy as np
>>> flash = [np.zeros((2, 8, 16, 2, 4), dtype=np.float16) for _ in range(3)]  # 3 layers
>>> layout = layout_from_tensors(flash, block_dim=1)
>>> len(layout.regions), layout.regions[1], layout.num_blocks
(6, Region(buffer_index=0, offset=2048, block_stride=256, block_bytes=256), 8)
>>> cpu = [np.zeros((8, 2, 16, 2 * 4), dtype=np.float16)]  # [blocks, heads, block_size, 2*head]
>>> layout_from_tensors(cpu, block_dim=0).regions
(Region(buffer_index=0, offset=0, block_stride=512, block_bytes=512),)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.dlpack import c_contiguous, dlpack_geometry
from kvxfer.errors import InvalidRequestError
from kvxfer.layout import MAX_REGIONS, Layout, ModelInfo, Region

__all__ = ["layout_from_tensors", "tensor_geometry"]


def tensor_geometry(obj: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``(shape, strides in bytes, item size)`` of a numpy, torch or CuPy tensor."""
    for name in ("__array_interface__", "__cuda_array_interface__"):
        face = getattr(obj, name, None)
        if face is None:
            continue
        try:
            shape = tuple(int(s) for s in face["shape"])
            itemsize = np.dtype(face["typestr"]).itemsize
        except (TypeError, KeyError):  # torch's bfloat16 has no typestr numpy reads: use DLPack
            break
        strides = face.get("strides")
        if strides is None:
            return shape, tuple(itemsize * math.prod(shape[i + 1 :]) for i in range(len(shape))), itemsize
        return shape, tuple(int(s) for s in strides), itemsize
    if hasattr(obj, "__dlpack__"):
        _, _, shape, strides, itemsize = dlpack_geometry(obj)
        return shape, strides, itemsize
    raise InvalidRequestError(f"a {type(obj).__name__} has no shape kvxfer can read (no array interface or DLPack)")


def layout_from_tensors(tensors: Sequence[Any], *, block_dim: int, model: ModelInfo | None = None) -> Layout:
    """The layout of a pool whose buffer *i* is ``tensors[i]``, blocks along ``block_dim``.

    Every tensor must have the same number of blocks, and each block's interior (the
    dimensions after ``block_dim``) must be contiguous.
    """
    if not tensors:
        raise InvalidRequestError("a layout needs at least one tensor")
    regions: list[Region] = []
    num_blocks = -1
    for i, tensor in enumerate(tensors):
        shape, strides, itemsize = tensor_geometry(tensor)
        if not 0 <= block_dim < len(shape):
            raise InvalidRequestError(f"tensor {i} has {len(shape)} dimensions; block_dim {block_dim} is not one")
        if num_blocks not in (-1, shape[block_dim]):
            raise InvalidRequestError(f"tensor {i} has {shape[block_dim]} blocks, tensor 0 has {num_blocks}")
        num_blocks = shape[block_dim]
        inner = shape[block_dim + 1 :]
        if not c_contiguous(inner, strides[block_dim + 1 :], itemsize):
            raise InvalidRequestError(f"tensor {i}: the dimensions inside a block are not contiguous")
        block_bytes = math.prod(inner) * itemsize
        outer = [range(n) for n in shape[:block_dim]]
        if math.prod(shape[:block_dim]) + len(regions) > MAX_REGIONS:
            raise InvalidRequestError(f"more than {MAX_REGIONS} regions: is block_dim {block_dim} right?")
        for index in itertools.product(*outer):
            offset = sum(k * s for k, s in zip(index, strides, strict=False))
            regions.append(Region(i, offset, strides[block_dim], block_bytes))
    return Layout(num_blocks, tuple(regions), model or ModelInfo())
