"""What the connector reads off vLLM's configuration: the KV element type, the attention
backend's KV shape and name, and the heads of each rank (vLLM is imported only where asked)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._tensors import SENTINEL_BLOCKS, HeadFacts

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["backend_name", "backend_shape", "head_facts", "kv_dtype", "total_kv_heads"]

log = logging.getLogger("vllm.kvxfer")


def kv_dtype(config: VllmConfig) -> str:
    """The KV cache's element type, as the fingerprint names it: ``cache_dtype`` unless it is
    ``auto`` (then the model's dtype), so an fp8 cache never meets a bf16 one."""
    cache_dtype = str(config.cache_config.cache_dtype)
    return cache_dtype if cache_dtype != "auto" else str(config.model_config.dtype).removeprefix("torch.")


def backend_shape(config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[int, ...] | None:
    """The attention backend's KV shape for :data:`SENTINEL_BLOCKS` blocks, or None when vLLM
    has no attention layers to ask (the shape alone then decides, see ``block_dim_of``)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    try:
        backends = get_current_attn_backends(config)
        spec: Any = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        shape = backends[0].get_kv_cache_shape(SENTINEL_BLOCKS, spec.block_size, spec.num_kv_heads, spec.head_size)
    except (AttributeError, IndexError, NotImplementedError, TypeError, ValueError) as exc:  # the shape decides
        log.info("kvxfer: the attention backend's KV shape is unknown (%s); reading the tensors' shapes", exc)
        return None
    return tuple(int(n) for n in shape)


def backend_name(config: VllmConfig) -> str:
    """The attention backend's name (part of the pool's KV format), "" when vLLM cannot say."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    try:
        return str(get_current_attn_backends(config)[0].get_name())
    except (AttributeError, IndexError, NotImplementedError, TypeError, ValueError):
        return ""


def total_kv_heads(config: VllmConfig) -> int:
    """The model's KV heads before the tensor-parallel split (0 when vLLM cannot say). MLA's
    latent KV is one "head" every rank holds whole, whatever the model's attention heads.

    >>> from types import SimpleNamespace as NS
    >>> def config(mla):
    ...     return NS(model_config=NS(use_mla=mla, get_total_num_kv_heads=lambda: 128))
    >>> total_kv_heads(config(False)), total_kv_heads(config(True))
    (128, 1)
    """
    try:
        if getattr(config.model_config, "use_mla", False):
            return 1  # vLLM gives each rank one KV "head" then (ModelConfig.get_num_kv_heads)
        return int(config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


def head_facts(config: VllmConfig, kv_cache_config: KVCacheConfig) -> HeadFacts | None:
    """What vLLM's KV cache spec says of this rank's heads (None for specs without heads)."""
    spec: Any = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    total = total_kv_heads(config)
    heads = getattr(spec, "num_kv_heads", 0)
    if len(kv_cache_config.kv_cache_groups) != 1 or not total or not heads:
        return None
    return HeadFacts(int(spec.block_size), int(heads), total)
