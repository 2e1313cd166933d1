"""The model both engines run and how its KV cache maps onto a kvxfer pool.

A small Llama-architecture causal LM is built from a config with a fixed seed, so every process
gets the same weights without downloading any. The pool uses the paged layout a serving engine
uses: per layer one ``[2, num_blocks, block_tokens, kv_heads, head_dim]`` tensor (K then V,
tokens-major: NHD), which is :meth:`kvxfer_client.Layout.paged_kv` with one buffer per layer.
A decode engine may run tensor-parallel ranks instead, each pool holding its share of the heads
heads-major (``[2, num_blocks, heads, block_tokens, head_dim]``, HND): every pool declares its
:class:`~kvxfer_client.KvGeometry`, and kvxfer maps one onto the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvxfer_client import HostBuffer, KvGeometry, Layout, ModelInfo

BLOCK_TOKENS = 16
SEED = 1234


def build_model() -> tuple[Any, LlamaConfig]:
    """The same weights in every process (fixed seed, one thread: bitwise-reproducible)."""
    torch.set_num_threads(1)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.train(False)  # inference mode: no dropout
    return model, config


@dataclass
class KvPool:
    """Host buffers laid out as a paged KV cache, one per layer."""

    config: LlamaConfig
    num_blocks: int
    buffers: list[HostBuffer]
    #: Tensor-parallel size and rank (which heads this pool holds), and the head order.
    tp: int = 1
    rank: int = 0
    order: str = "NHD"

    @classmethod
    def create(cls, config: LlamaConfig, num_blocks: int, tp: int = 1, rank: int = 0, order: str = "NHD") -> KvPool:
        pool = cls(config, num_blocks, [], tp, rank, order)
        pool.buffers = [HostBuffer.create(pool.layer_bytes) for _ in range(config.num_hidden_layers)]
        return pool

    @property
    def total_kv_heads(self) -> int:
        return int(self.config.num_key_value_heads or self.config.num_attention_heads)

    @property
    def kv_heads(self) -> int:
        """The heads this pool holds (its rank's share)."""
        return self.total_kv_heads // self.tp

    @property
    def head_dim(self) -> int:
        return int(self.config.hidden_size // self.config.num_attention_heads)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or V) in one layer."""
        return BLOCK_TOKENS * self.kv_heads * self.head_dim * 4

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    def layout(self) -> Layout:
        info = ModelInfo("tiny-llama-seed1234", "float32", BLOCK_TOKENS, tp_size=self.tp, tp_rank=self.rank)
        return Layout.paged_kv(
            num_layers=self.config.num_hidden_layers,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            model=info,
            geometry=KvGeometry(BLOCK_TOKENS, self.total_kv_heads, self.head_dim * 4, self.order),  # type: ignore[arg-type]
        )

    def layer(self, index: int) -> torch.Tensor:
        """Layer ``index`` as ``[2, num_blocks, BLOCK_TOKENS, kv_heads, head_dim]`` (a view,
        whatever the order in memory)."""
        flat = torch.from_numpy(self.buffers[index].array().view(np.float32))
        if self.order == "HND":
            return flat.view(2, self.num_blocks, self.kv_heads, BLOCK_TOKENS, self.head_dim).transpose(2, 3)
        return flat.view(2, self.num_blocks, BLOCK_TOKENS, self.kv_heads, self.head_dim)

    def write(self, cache: Any, block_ids: list[int]) -> None:
        """Store a one-sequence cache's K and V into ``block_ids`` (token t in block t // 16)."""
        for index in range(len(cache.layers)):
            self.write_layer(cache, index, block_ids)

    def write_layer(self, cache: Any, index: int, block_ids: list[int]) -> None:
        """Store layer ``index`` of a one-sequence cache (the rest may not exist yet)."""
        ids = torch.tensor(block_ids)
        layer, dst = cache.layers[index], self.layer(index)
        for kv, src in enumerate((layer.keys, layer.values)):
            tokens = src[0].transpose(0, 1)  # [T, heads, dim]
            padded = torch.zeros(len(block_ids) * BLOCK_TOKENS, *tokens.shape[1:], dtype=tokens.dtype)
            padded[: tokens.shape[0]] = tokens
            dst[kv, ids] = padded.view(len(block_ids), BLOCK_TOKENS, *tokens.shape[1:])

    def read(self, block_ids: list[int], num_tokens: int) -> Any:
        """A model cache holding the first ``num_tokens`` tokens stored in ``block_ids``."""
        return read_ranks([self], block_ids, num_tokens)

    def close(self) -> None:
        for b in self.buffers:
            b.close()


def read_ranks(pools: list[KvPool], block_ids: list[int], num_tokens: int) -> Any:
    """A model cache from tensor-parallel ranks' pools (in rank order: their heads side by side)."""
    ids = torch.tensor(block_ids)
    cache = DynamicCache(config=pools[0].config)
    for index in range(pools[0].config.num_hidden_layers):
        planes = []
        for kv in range(2):
            parts = [p.layer(index)[kv, ids] for p in pools]  # each [blocks, tokens, heads, dim]
            whole = torch.cat(parts, dim=2)
            planes.append(whole.reshape(-1, *whole.shape[2:])[:num_tokens].transpose(0, 1).unsqueeze(0).contiguous())
        cache.update(planes[0], planes[1], index)
    return cache


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_TOKENS)


@torch.no_grad()
def prefill(model: Any, prompt: list[int]) -> tuple[Any, int]:
    """Run the prompt; returns its cache and the first generated token (greedy)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    return out.past_key_values, int(out.logits[0, -1].argmax())


@torch.no_grad()
def prefill_by_layer(model: Any, prompt: list[int], after_layer: Any) -> int:
    """Run the prompt, calling ``after_layer(cache, index)`` as each decoder layer finishes
    (its K and V are in the cache then; later layers' are not yet); returns the first token."""
    cache = DynamicCache(config=model.config)
    hooks = [
        layer.register_forward_hook(lambda _m, _a, _o, index=index: after_layer(cache, index))
        for index, layer in enumerate(model.model.layers)
    ]
    try:
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    return int(out.logits[0, -1].argmax())


@torch.no_grad()
def decode(model: Any, cache: Any, first_token: int, max_tokens: int) -> list[int]:
    """Greedy decoding from a prompt's cache and its first token: ``max_tokens`` tokens."""
    tokens = [first_token]
    while len(tokens) < max_tokens:
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def generate(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """The single-process reference: prefill and decode in one place, no transfer."""
    cache, first = prefill(model, prompt)
    return decode(model, cache, first, max_tokens)


def prompt_tokens(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1024, length)]
