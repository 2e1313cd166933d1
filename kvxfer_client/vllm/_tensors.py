"""What the connector reads off vLLM's KV tensors: which dimension counts blocks, the pool's
head geometry and KV format, and from them the layout the rank's pool is registered with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import KvxferError
from kvxfer.geometry import KvGeometry, rank_heads
from kvxfer.layout import Layout, ModelInfo

from .._tensor_layout import layout_from_tensors, tensor_geometry

__all__ = ["SENTINEL_BLOCKS", "HeadFacts", "block_dim_of", "kv_format_of", "kv_geometry", "pool_layout"]

#: A block count no KV dimension has, to find where the backend puts the blocks.
SENTINEL_BLOCKS = 7919


@dataclass(frozen=True)
class HeadFacts:
    """What vLLM's KV cache spec and model config say of one rank's heads."""

    block_size: int
    #: This rank's KV heads, and the model's before the tensor-parallel split.
    heads: int
    total_heads: int


def kv_geometry(tensor: Any, block_dim: int, layout: Any, facts: HeadFacts, model: ModelInfo) -> KvGeometry | None:
    """The geometry of vLLM's KV tensors, or None when it cannot be read unambiguously (the
    pool then only meets pools of the same TP and layout).

    Every region must be ``block_size x heads`` pieces of the same size (one head of one token:
    K and V together for the CPU backend's packed content, one of them for split planes); the
    head order is read off the strides of the heads and tokens dimensions.

    >>> import numpy as np
    >>> from kvxfer_client import layout_from_tensors
    >>> cpu = np.zeros((8, 2, 16, 256), dtype=np.uint16)  # [blocks, heads, tokens, 2 * head]
    >>> m = ModelInfo("m", "bf16", 16, tp_size=2, tp_rank=1)
    >>> kv_geometry(cpu, 0, layout_from_tensors([cpu], block_dim=0), HeadFacts(16, 2, 4), m)
    KvGeometry(block_tokens=16, total_kv_heads=4, head_bytes=512, order='HND')
    """
    if rank_heads(facts.total_heads, max(1, model.tp_size), model.tp_rank).count != facts.heads:
        return None
    sizes = {r.block_bytes for r in layout.regions}
    piece = facts.block_size * facts.heads
    if len(sizes) != 1 or next(iter(sizes)) % piece:
        return None
    head_bytes = next(iter(sizes)) // piece
    shape, strides, _ = tensor_geometry(tensor)
    dims = list(range(block_dim + 1, len(shape)))  # inside a block (outer dims are regions: K/V)
    head_dims = [d for d in dims if shape[d] == facts.heads]
    token_dims = [d for d in dims if shape[d] == facts.block_size]
    order = "HND"
    if facts.heads > 1:
        pairs = [(h, t) for h in head_dims for t in token_dims if h != t]
        if len(pairs) != 1:
            return None  # e.g. as many heads as tokens per block: the sizes cannot tell
        h, t = pairs[0]
        order = "HND" if strides[h] > strides[t] else "NHD"
    return KvGeometry(facts.block_size, facts.total_heads, head_bytes, order)  # type: ignore[arg-type]


def kv_format_of(tensor: Any, block_dim: int, geometry: KvGeometry | None, backend: str) -> str:
    """The pool's KV format (common.proto, ModelInfo.kv_format): what the fingerprint must
    hold of the in-block layout beyond the sizes. Without a geometry, the whole shape (blocks
    as ``B``) and the attention backend: engines whose kernels lay blocks out differently never
    meet. With one, only what no mapping bridges: how K and V share a region (a mapping handles
    TP, head order and block size, and the geometry holds the bytes per head).

    >>> import numpy as np
    >>> cpu = np.zeros((8, 2, 16, 256), dtype=np.uint16)       # [blocks, heads, tokens, K|V]
    >>> kv_format_of(cpu, 0, None, "CPU_ATTN")
    'vllm/CPU_ATTN [B,2,16,256] x2'
    >>> g = KvGeometry(16, 4, 512, "HND")
    >>> kv_format_of(cpu, 0, g, "CPU_ATTN"), kv_format_of(np.zeros((2, 8, 16, 2, 128)), 1, g, "FLASH")
    ('vllm kv=packed', 'vllm kv=planes')
    """
    shape, _, itemsize = tensor_geometry(tensor)
    if geometry is not None:
        return f"vllm kv={'planes' if block_dim else 'packed'}"
    dims = ["B" if d == block_dim else str(n) for d, n in enumerate(shape)]
    name = f"vllm/{backend}" if backend else "vllm"
    return f"{name} [{','.join(dims)}] x{itemsize}"


def block_dim_of(tensor: Any, num_blocks: int, backend_shape: tuple[int, ...] | None = None) -> int:
    """Which dimension of a KV tensor counts blocks.

    ``backend_shape`` is the attention backend's ``get_kv_cache_shape`` for a block count no
    other dimension has (the connector asks the backend): where that count sits is the block
    dimension. Without it, the first of the first two dimensions whose size is ``num_blocks``
    (``[num_blocks, ...]`` or ``[2, num_blocks, ...]``), refused when both are.

    >>> import numpy as np
    >>> block_dim_of(np.zeros((2, 5, 4)), 5), block_dim_of(np.zeros((5, 2, 4)), 5)
    (1, 0)
    >>> block_dim_of(np.zeros((2, 2, 4)), 2, backend_shape=(2, SENTINEL_BLOCKS, 4))
    1
    """
    shape = tensor_geometry(tensor)[0]
    if backend_shape is not None and backend_shape.count(SENTINEL_BLOCKS) == 1 and len(backend_shape) == len(shape):
        return backend_shape.index(SENTINEL_BLOCKS)
    dims = [dim for dim in (0, 1) if dim < len(shape) and shape[dim] == num_blocks]
    if len(dims) == 1:
        return dims[0]
    if not dims:
        raise KvxferError(f"cannot find the block dimension ({num_blocks} blocks) in a KV tensor of shape {shape}")
    raise KvxferError(
        f"a KV tensor of shape {shape} with {num_blocks} blocks: dimensions 0 and 1 could both count blocks, "
        "and the attention backend was not found to tell (give the engine more KV blocks)"
    )


def pool_layout(
    tensors: list[Any],
    num_blocks: int,
    model: ModelInfo,
    backend_shape: tuple[int, ...] | None = None,
    heads: HeadFacts | None = None,
    backend: str = "",
) -> Layout:
    """The layout of a rank's KV tensors (one buffer per layer): ``backend_shape`` as
    :func:`block_dim_of` takes it; ``heads``: what vLLM says of the heads, to declare the
    pool's geometry (then other TP sizes can pull from it); ``backend``: the attention
    backend's name, for the pool's KV format."""
    block_dim = block_dim_of(tensors[0], num_blocks, backend_shape)
    layout = layout_from_tensors(tensors, block_dim=block_dim, model=model)
    geometry = kv_geometry(tensors[0], block_dim, layout, heads, model) if heads is not None else None
    if geometry is not None:
        layout = dataclasses.replace(layout, geometry=geometry)
    kv_format = kv_format_of(tensors[0], block_dim, geometry, backend)
    return dataclasses.replace(layout, model=dataclasses.replace(layout.model, kv_format=kv_format))
