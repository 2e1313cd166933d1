"""The node's KV tier as SGLang's HiCache storage (its L3): prefixes one SGLang engine stored,
other engines of the node load, and engines of other nodes through their daemons.

SGLang loads it by module path::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvxfer",
        "module_path": "kvxfer_client.sglang.hicache", "class_name": "KvxferHiCacheStorage",
        "interface_v1": 1, "salt": "tenant-a"}'

``interface_v1`` makes SGLang call the zero-copy methods (``batch_exists``,
``batch_get_v1``, ``batch_set_v1``): the daemon copies pages between the tier and SGLang's host
KV pool, which this backend registers with it, and no page goes through Python. The tier keeps
a namespace per model, dtype, host layout and tensor-parallel rank (what the pool's layout
says), under the optional ``salt`` (at most 64 bytes: one per tenant keeps tenants apart);
``from_peer`` (``host:port`` of another node's kvxferd) reads that node's tier instead.

The tier is the daemon's memory: a daemon that restarted holds nothing, which SGLang sees as
misses, and a daemon that cannot be reached answers every call as a miss (logged), never
an error in SGLang's cache thread.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvxfer.errors import InvalidRequestError, KvxferError
from kvxfer.layout import ModelInfo

from .._blocking import KvxferClient
from .._results import Pool
from .._tensor_layout import layout_from_tensors

__all__ = ["KvxferHiCacheStorage", "tier_key"]

logger = logging.getLogger("kvxfer_client.sglang")

#: How long a call waits for a daemon that is away to come back before it is a miss, seconds.
RECONNECT_WAIT_S = 2.0

#: How each host layout of SGLang's becomes [K/V, ..., page, rest]: how many leading dimensions
#: of the buffer stay before the page one (which is then the block dimension).
_LEADING = {
    "layer_first": 2,  # [2, layers, tokens, heads, dim] -> [2, layers, pages, page bytes]
    "page_first": 1,  # [2, tokens, layers, heads, dim] -> [2, pages, page bytes]
    "page_first_direct": 1,  # [2, pages, layers, page, heads, dim] -> [2, pages, page bytes]
}


def tier_key(key: str) -> bytes:
    """An SGLang page hash as a tier key (at most 64 bytes: longer ones are hashed).

    >>> tier_key("ab" * 32) == ("ab" * 32).encode(), len(tier_key("x" * 65))
    (True, 32)
    """
    raw = key.encode()
    return raw if len(raw) <= 64 else hashlib.sha256(raw).digest()


class KvxferHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` on the node's KV tier (zero-copy interface)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise InvalidRequestError(
                'kvxfer\'s HiCache storage copies pages itself: add "interface_v1": 1 to '
                "--hicache-storage-backend-extra-config"
            )
        self.salt = str(extra.get("salt", "")).encode()
        if len(self.salt) > 64:
            raise InvalidRequestError("the HiCache salt is at most 64 bytes")
        self.from_peer = str(extra.get("from_peer", ""))
        self.config = storage_config
        # A lookup answers within seconds or is a miss: SGLang's cache thread must not wait on a
        # daemon that is away (calls wait timeout_s for it to come back).
        self.client = KvxferClient(
            engine_name=f"sglang-hicache-tp{storage_config.tp_rank}", auto_reconnect=True, timeout_s=RECONNECT_WAIT_S
        )
        self.pool: Pool | None = None
        self.page_size = 0

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register SGLang's host KV pool with the daemon: a block per page."""
        super().register_mem_pool_host(mem_pool_host)
        layout_name = str(mem_pool_host.layout)
        if layout_name not in _LEADING:
            raise InvalidRequestError(f"host layout {layout_name!r}: kvxfer's HiCache storage takes {sorted(_LEADING)}")
        page_dim = _LEADING[layout_name]
        buffer = mem_pool_host.kv_buffer
        shape: tuple[int, ...] = (*tuple(buffer.shape)[:page_dim], int(mem_pool_host.page_num), -1)
        view = buffer.view(shape)
        c = self.config
        model = ModelInfo(
            model=c.model_name or "",
            dtype=str(mem_pool_host.dtype).removeprefix("torch."),
            block_tokens=int(mem_pool_host.page_size),
            tp_size=c.tp_size,
            tp_rank=c.tp_rank,
            kv_format=f"sglang-hicache-{layout_name}",
        )
        layout = layout_from_tensors([view], block_dim=page_dim, model=model)
        self.page_size = int(mem_pool_host.page_size)
        self.pool = self.client.register_pool([view], layout, name=f"sglang-hicache-tp{c.tp_rank}")
        logger.info("kvxfer: HiCache on the node's tier, %d host pages (%s)", layout.num_blocks, layout_name)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the tier holds."""
        try:
            return self.client.tier_lookup(
                self._pool(), [tier_key(k) for k in keys], salt=self.salt, from_peer=self.from_peer
            )
        except KvxferError as exc:
            logger.warning("kvxfer: HiCache lookup answered as a miss: %s", exc)
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Load the longest stored prefix of ``keys`` into the host pages at ``host_indices``."""
        try:
            loaded = self.client.tier_load(
                self._pool(), self._pages(host_indices, len(keys)), [tier_key(k) for k in keys],
                salt=self.salt, from_peer=self.from_peer,
            )  # fmt: skip
        except KvxferError as exc:
            logger.warning("kvxfer: HiCache load answered as a miss: %s", exc)
            loaded = 0
        return [i < loaded for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Store the host pages at ``host_indices`` under ``keys`` (already stored counts as done)."""
        try:
            self.client.tier_store(
                self._pool(), self._pages(host_indices, len(keys)), [tier_key(k) for k in keys], salt=self.salt
            )
        except KvxferError as exc:
            logger.warning("kvxfer: HiCache store not done: %s", exc)
            return [False] * len(keys)
        return [True] * len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # SGLang's value-copying interface: this backend moves pages itself (interface_v1).
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("kvxfer's HiCache storage is zero-copy: use interface_v1")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("kvxfer's HiCache storage is zero-copy: use interface_v1")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvxfer's HiCache storage is zero-copy: use interface_v1")

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        raise NotImplementedError("kvxfer's HiCache storage is zero-copy: use interface_v1")

    def _pool(self) -> Pool:
        if self.pool is None:
            raise InvalidRequestError("SGLang has not registered its host pool with this storage yet")
        return self.pool

    def _pages(self, host_indices: Any, count: int) -> list[int]:
        """The host pages of ``count`` pages' token indices (a page's first token / page size)."""
        tokens = np.asarray(host_indices.cpu() if hasattr(host_indices, "cpu") else host_indices, dtype=np.int64)
        firsts = tokens[:: self.page_size][:count]
        if len(firsts) != count or bool((firsts % self.page_size).any()):
            raise InvalidRequestError(f"{len(tokens)} host token indices are not {count} whole pages")
        pages: list[int] = (firsts // self.page_size).tolist()
        return pages

    def clear(self) -> None:
        """Nothing to clear here: the tier is the node's, not this engine's."""

    def close(self) -> None:
        self.client.close()
