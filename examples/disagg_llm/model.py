"""The model both engines run and how its KV cache maps onto a kvxfer pool.

A small Llama-architecture causal LM is built from a config with a fixed seed, so every process
gets the same weights without downloading any. The pool uses the paged layout a serving engine
uses: per layer one ``[2, num_blocks, block_tokens, kv_heads, head_dim]`` tensor (K then V),
which is :meth:`kvxfer_client.Layout.paged_kv` with one buffer per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvxfer_client import HostBuffer, Layout, ModelInfo

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

    @classmethod
    def create(cls, config: LlamaConfig, num_blocks: int) -> KvPool:
        pool = cls(config, num_blocks, [])
        pool.buffers = [HostBuffer.create(pool.layer_bytes) for _ in range(config.num_hidden_layers)]
        return pool

    @property
    def kv_heads(self) -> int:
        return int(self.config.num_key_value_heads or self.config.num_attention_heads)

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
        info = ModelInfo(model="tiny-llama-seed1234", dtype="float32", block_tokens=BLOCK_TOKENS)
        return Layout.paged_kv(
            num_layers=self.config.num_hidden_layers,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            model=info,
        )

    def layer(self, index: int) -> torch.Tensor:
        """Layer ``index`` as ``[2, num_blocks, BLOCK_TOKENS, kv_heads, head_dim]`` (a view)."""
        flat = torch.from_numpy(self.buffers[index].array().view(np.float32))
        return flat.view(2, self.num_blocks, BLOCK_TOKENS, self.kv_heads, self.head_dim)

    def write(self, cache: Any, block_ids: list[int]) -> None:
        """Store a one-sequence cache's K and V into ``block_ids`` (token t in block t // 16)."""
        ids = torch.tensor(block_ids)
        for index, layer in enumerate(cache.layers):
            dst = self.layer(index)
            for kv, src in enumerate((layer.keys, layer.values)):
                tokens = src[0].transpose(0, 1)  # [T, heads, dim]
                padded = torch.zeros(len(block_ids) * BLOCK_TOKENS, *tokens.shape[1:], dtype=tokens.dtype)
                padded[: tokens.shape[0]] = tokens
                dst[kv, ids] = padded.view(len(block_ids), BLOCK_TOKENS, *tokens.shape[1:])

    def read(self, block_ids: list[int], num_tokens: int) -> Any:
        """A model cache holding the first ``num_tokens`` tokens stored in ``block_ids``."""
        ids = torch.tensor(block_ids)
        cache = DynamicCache(config=self.config)
        for index in range(self.config.num_hidden_layers):
            src = self.layer(index)
            k, v = (
                src[kv, ids].reshape(-1, *src.shape[3:])[:num_tokens].transpose(0, 1).unsqueeze(0).contiguous()
                for kv in range(2)
            )
            cache.update(k, v, index)
        return cache

    def close(self) -> None:
        for b in self.buffers:
            b.close()


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_TOKENS)


@torch.no_grad()
def prefill(model: Any, prompt: list[int]) -> tuple[Any, int]:
    """Run the prompt; returns its cache and the first generated token (greedy)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    return out.past_key_values, int(out.logits[0, -1].argmax())


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
