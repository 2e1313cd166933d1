"""A hybrid model's memory for ``bench.sglang_rank``: SGLang's own pools, built on CPU.

- ``swa``: SGLang's ``SWAKVPool``, layer 0 sliding-window (its pages in a pool of their own),
  layer 1 full attention; the window pages are a state component SGLang names ``swa``.
- ``mamba``: SGLang's ``HybridReqToTokenPool`` (a Mamba2 layer's conv and SSM rows, a slot
  per request) beside a ``HybridLinearKVPool`` (layer 1 full attention): state ``mamba``.

The prefill rank writes a known pattern into the request's state rows (window pages: the
rank's heads of each token; a Mamba slot: its bytes); the decode rank checks its own.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

POOL_TOKENS, SWA_TOKENS, SLOTS = 4096, 2048, 16
KINDS = ("mha", "swa", "mamba")


class HybridState:
    """The pools of one rank of a ``kind`` model (``heads``: the model's KV heads and the
    slice of them this rank holds; heads of ``head_dim``, pages of ``page`` tokens), and the
    request rows of its state."""

    def __init__(self, kind: str, heads: tuple[int, slice], head_dim: int, page: int) -> None:
        import torch

        self.kind, self.page, self.head_dim = kind, page, head_dim
        self.total_heads, self.heads = heads
        count = self.heads.stop - self.heads.start
        if kind == "swa":
            from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

            self.pool = SWAKVPool(
                size=POOL_TOKENS, size_swa=SWA_TOKENS, page_size=page, dtype=torch.bfloat16, head_num=count,
                head_dim=head_dim, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu",
            )  # fmt: skip
            self.free = list(range(1, SWA_TOKENS // page))  # page 0: SGLang's padding page
        else:
            from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
            from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

            shape = Mamba2StateShape.create(
                tp_world_size=1, intermediate_size=128, n_groups=1, num_heads=4, head_dim=32, state_size=16,
                conv_kernel=4,
            )  # fmt: skip
            self.req_to_token = HybridReqToTokenPool(
                size=SLOTS, mamba_size=SLOTS, mamba_spec_state_size=0, max_context_len=POOL_TOKENS, device="cpu",
                enable_memory_saver=False, cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
                mamba_layer_ids=[0], enable_mamba_extra_buffer=False,
            )  # fmt: skip
            self.pool = HybridLinearKVPool(
                size=POOL_TOKENS, dtype=torch.bfloat16, page_size=page, head_num=count, head_dim=head_dim,
                full_attention_layer_ids=[1], device="cpu", mamba_pool=self.req_to_token.mamba_pool,
            )  # fmt: skip
            self.free = list(range(SLOTS))
        #: The full-attention layers' pool (the KV pages SGLang transfers as such).
        self.full = self.pool.full_kv_pool
        self.buffers: list[np.ndarray[Any, Any]] = []

    def bind(self, kv_args: Any) -> None:
        """Views of the state buffers SGLang declared in ``kv_args`` (after its setup), a row
        per line."""
        [ptrs], [lens], [items] = kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens
        for ptr, length, item in zip(ptrs, lens, items, strict=True):
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(ptr))
            self.buffers.append(raw[: length // item * item].reshape(-1, item))

    def allocate(self, pages: int) -> list[int]:
        """The request's state rows: a window page per KV page, or one Mamba slot."""
        return [self.free.pop() for _ in range(pages if self.kind == "swa" else 1)]

    def write(self, room: int, rows: list[int]) -> None:
        for buffer, want in zip(self.buffers, self._pattern(room, len(rows)), strict=True):
            self._view(buffer)[rows] = want

    def bad_elements(self, room: int, rows: list[int]) -> int:
        """How many elements of the request's state rows differ from what the prefill wrote."""
        wanted = self._pattern(room, len(rows))
        return sum(int((self._view(b)[rows] != w).sum()) for b, w in zip(self.buffers, wanted, strict=True))

    def _view(self, buffer: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """A window page as [token, head, dim] of bfloat16 bits; a Mamba row as bytes."""
        if self.kind != "swa":
            return buffer
        return buffer.view(np.uint16).reshape(buffer.shape[0], self.page, -1, self.head_dim)

    def _pattern(self, room: int, rows: int) -> list[np.ndarray[Any, Any]]:
        """Each buffer's rows of the request: for window pages the model's every head, of
        which this rank holds its own; for a Mamba slot its bytes."""
        rng = np.random.default_rng(room ^ 0x5EED)
        if self.kind == "swa":
            size = (rows, self.page, self.total_heads, self.head_dim)
            return [rng.integers(0, 1 << 15, size=size, dtype=np.uint16)[:, :, self.heads] for _ in self.buffers]
        return [rng.integers(0, 256, size=(rows, b.shape[1]), dtype=np.uint8) for b in self.buffers]
