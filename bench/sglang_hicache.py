"""An SGLang engine's HiCache storage on kvxfer's tier, in a process of its own, driven by a test.

It builds what SGLang's HiCache controller builds: a CPU ``MHATokenToKVPool``, the
``MHATokenToKVPoolHost`` over it in the given host layout, ``HiCacheStorageConfig``, and the
storage backend through SGLang's ``StorageBackendFactory`` (``dynamic``, by module path, as
``--hicache-storage-backend dynamic`` loads one), then registers the host pool with it. Each
command stores or loads pages of the host pool the way SGLang's cache controller calls the
zero-copy interface (page hashes, host token indices).

Usage: ``python -m bench.sglang_hicache LAYOUT SALT MODEL_DIR [FROM_PEER]`` (``$KVXFER_SOCKET``:
its daemon; ``FROM_PEER``: read another node's tier, its kvxferd's peer address).
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import numpy as np

from bench.cluster import Daemon
from bench.sglang_proc import SglangProcess, serve
from bench.sglang_rank import HEAD_DIM, HEADS, LAYERS, PAGE


class HiCacheEngine:
    def __init__(self, layout: str, salt: str, model: str, from_peer: str = "") -> None:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        device = MHATokenToKVPool(1024, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False)
        self.host = MHATokenToKVPoolHost(
            device._mha_buffer_info(), host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout,
            pin_memory=False, device="cpu", device_capacity_tokens=1024, start_layer=0, end_layer=LAYERS,
        )  # fmt: skip
        extra = {
            "backend_name": "kvxfer",
            "module_path": "kvxfer_client.sglang.hicache",
            "class_name": "KvxferHiCacheStorage",
            "interface_v1": 1,
            "salt": salt,
            "from_peer": from_peer,
        }
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=layout.startswith("page_first"),
            model_name=model, extra_config=extra,
        )  # fmt: skip
        self.storage = StorageBackendFactory.create_backend("dynamic", config, self.host)
        self.storage.register_mem_pool_host(self.host)
        self.next_page = 1

    def _indices(self, pages: int) -> Any:
        import torch

        first, self.next_page = self.next_page, self.next_page + pages
        return torch.arange(first * PAGE, (first + pages) * PAGE, dtype=torch.int64)

    def _page_bytes(self, index: int) -> np.ndarray[Any, Any]:
        return self.host.get_data_page(index, flat=True).view(dtype=__import__("torch").int16).numpy()

    def store(self, keys: list[str], seed: int) -> list[bool]:
        """Fill fresh host pages with the pattern of ``seed`` and store them under ``keys``."""
        import torch

        indices = self._indices(len(keys))
        for i in range(len(keys)):
            page = torch.from_numpy(_pattern(seed, i, self._page_bytes(0).size))
            self.host.set_from_flat_data_page(int(indices[i * PAGE]), page.view(self.host.dtype))
        return list(self.storage.batch_set_v1(keys, indices))

    def exists(self, keys: list[str]) -> int:
        return int(self.storage.batch_exists(keys))

    def load(self, keys: list[str], seed: int) -> dict[str, Any]:
        """Load ``keys`` into fresh host pages; how many loaded and how many differ from ``seed``."""
        indices = self._indices(len(keys))
        got = self.storage.batch_get_v1(keys, indices)
        loaded = sum(1 for ok in got if ok)
        bad = [
            i
            for i in range(loaded)
            if not np.array_equal(self._page_bytes(int(indices[i * PAGE])), _pattern(seed, i, None))
        ]
        return {"loaded": loaded, "ok": list(got), "bad_pages": bad}


def _pattern(seed: int, page: int, size: int | None) -> np.ndarray[Any, Any]:
    n = size if size is not None else LAYERS * 2 * PAGE * HEADS * HEAD_DIM
    return np.random.default_rng([seed, page]).integers(0, 1 << 15, size=n, dtype=np.int16)


class SglangHiCache(SglangProcess):
    def __init__(self, layout: str, salt: str, model: str, daemon: Daemon, name: str, from_peer: str = "") -> None:
        super().__init__("bench.sglang_hicache", [layout, salt, model, from_peer], daemon, name)


def main() -> None:
    try:
        worker = HiCacheEngine(*sys.argv[1:5])
    except Exception as exc:  # noqa: BLE001 - the test shows why the engine did not start
        print("@@" + json.dumps({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}), flush=True)
        return
    serve(worker)


if __name__ == "__main__":
    main()
