"""Multi-turn conversations through the node's KV tier: hits, tokens not recomputed, and the
tier's copy speed against the same run's memcpy.

One daemon with a host tier, one engine whose pool holds about one conversation. Each turn
of each conversation (turns round-robin over the conversations, so they compete for the
tier) looks up its prompt's chained keys, loads the stored prefix into the pool, "computes"
the rest (writes each new block's key into it, standing in for the forward pass) and stores
the new blocks. The conversations' KV ends up several times what the engine holds and more
than the tier holds, so the tier evicts. Every loaded block is checked to carry its key.

With ``--disk-dir`` a disk tier sits below host memory (``--disk-gib``): chunks evicted from
memory spill there and come back on load. The same run then also times sequential 2 MiB
writes and reads of a 1 GiB file in that directory (``O_DIRECT`` where allowed), the disk's
ceiling.

Reports: hit rate over the keys looked up (and the share served from disk), prompt tokens not
recomputed, store and load GB/s (engine calls, Llama-3-8B-shaped 2 MiB blocks; with a disk,
spills and read-backs included) and each over the same run's single-thread memcpy of 512 MiB
(numpy ``copyto``, median of 5).

Run: ``python -m bench.tier [--conversations 8] [--turns 6] [--tier-gib 2] [--disk-dir D
--disk-gib 4]``; one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer_client import AsyncKvxferClient, HostBuffer, Layout, ModelInfo

from .cluster import Cluster

LAYERS, BLOCK_TOKENS, TURN_TOKENS = 32, 16, 512
REGION_BYTES = BLOCK_TOKENS * 8 * 128 * 2  # 8 KV heads of 128, bf16: 32 KiB
POOL_BLOCKS = 256  # 512 MiB: about one conversation


def memcpy_gbps(nbytes: int = 512 << 20, rounds: int = 5) -> float:
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def disk_gbps(directory: str, nbytes: int = 1 << 30, piece: int = 2 << 20) -> tuple[float, float]:
    """Sequential write and read of one file in ``directory`` (O_DIRECT where allowed)."""
    import mmap
    import os

    path = os.path.join(directory, "bench-ceiling.bin")
    buf = mmap.mmap(-1, piece)
    buf.write(os.urandom(piece))
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        fd = os.open(path, flags, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, piece):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, nbytes, piece):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9


def _keys(conversation: int, blocks: int) -> list[bytes]:
    out, prev = [], f"conversation-{conversation}".encode()
    for i in range(blocks):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


async def run_async(
    conversations: int,
    turns: int,
    tier_bytes: int,
    emit: Callable[[dict[str, Any]], None],
    disk_dir: str = "",
    disk_bytes: int = 0,
) -> None:
    layout = Layout.paged_kv(
        num_layers=LAYERS, num_blocks=POOL_BLOCKS, block_bytes=REGION_BYTES, model=ModelInfo("llama-3-8b", "bf16", 16)
    )
    per_turn = TURN_TOKENS // BLOCK_TOKENS
    ceiling = memcpy_gbps()
    disk_args = ("--tier-disk-dir", disk_dir, "--tier-disk-bytes", str(disk_bytes)) if disk_dir else ()
    with Cluster() as cluster:
        daemon = cluster.daemon("tier", "--tier-host-bytes", str(tier_bytes), *disk_args)
        async with AsyncKvxferClient(daemon.socket, engine_name="engine") as engine:
            buffers = [HostBuffer.create(s) for s in layout.buffer_sizes()]
            arrays = [b.array() for b in buffers]
            pool = await engine.register_pool(buffers, layout)
            looked = hits = computed = 0
            store_bytes = load_bytes = 0
            store_s = load_s = 0.0
            for turn in range(1, turns + 1):
                for c in range(conversations):
                    blocks = min(turn * per_turn, POOL_BLOCKS)
                    keys = _keys(c, blocks)
                    ids = list(range(blocks))
                    found = await engine.tier_lookup(pool, keys)
                    t0 = time.perf_counter()
                    loaded = await engine.tier_load(pool, ids[:found], keys[:found]) if found else 0
                    load_s += time.perf_counter() - t0
                    for b in range(loaded):  # what came back is what was stored under that key
                        r = layout.regions[(b * 7) % len(layout.regions)]
                        start = r.offset + b * r.block_stride
                        assert bytes(arrays[r.buffer_index][start : start + 32]) == keys[b], (c, turn, b)
                    for b in range(loaded, blocks):  # the forward pass writes the rest
                        for r in layout.regions:
                            start = r.offset + b * r.block_stride
                            arrays[r.buffer_index][start : start + 32] = np.frombuffer(keys[b], dtype=np.uint8)
                    t0 = time.perf_counter()
                    stored, _ = await engine.tier_store(pool, ids[loaded:], keys[loaded:])
                    store_s += time.perf_counter() - t0
                    looked, hits, computed = looked + blocks, hits + loaded, computed + blocks - loaded
                    load_bytes += loaded * layout.bytes_per_block
                    store_bytes += stored * layout.bytes_per_block
            tier = await _tier(daemon.socket)
    disk: dict[str, Any] = {}
    if disk_dir:
        write, read = disk_gbps(disk_dir)
        disk = {
            "disk_gib": round(disk_bytes / 2**30, 2),
            "hits_from_disk": tier["disk_hits"],
            "disk_failures": tier["disk_failures"],
            "disk_write_gbps": round(write, 2),
            "disk_read_gbps": round(read, 2),
        }
    load_gbps = load_bytes / load_s / 1e9 if load_s else 0.0
    store_gbps = store_bytes / store_s / 1e9 if store_s else 0.0
    emit(
        {
            "conversations": conversations,
            "turns": turns,
            "kv_gib_at_end": round(
                conversations * min(turns * per_turn, POOL_BLOCKS) * layout.bytes_per_block / 2**30, 2
            ),
            "engine_gib": round(POOL_BLOCKS * layout.bytes_per_block / 2**30, 2),
            "tier_gib": round(tier_bytes / 2**30, 2),
            "hit_rate": round(hits / looked, 3),
            "prompt_tokens_not_recomputed": hits * BLOCK_TOKENS,
            "prompt_tokens_recomputed": computed * BLOCK_TOKENS,
            "evictions": tier["evictions"],
            "memcpy_gbps": round(ceiling, 2),
            "load_gbps": round(load_gbps, 2),
            "store_gbps": round(store_gbps, 2),
            "load_vs_memcpy": round(load_gbps / ceiling, 2),
            "store_vs_memcpy": round(store_gbps / ceiling, 2),
            **disk,
        }
    )


async def _tier(socket_path: str) -> dict[str, int]:
    import grpc

    from kvxfer.proto import admin_pb2, admin_pb2_grpc

    async with grpc.aio.insecure_channel("unix:" + socket_path) as channel:
        resp = await admin_pb2_grpc.AdminServiceStub(channel).ListTier(admin_pb2.ListTierRequest(), timeout=5)
    return {
        "evictions": sum(n.evictions for n in resp.namespaces),
        "disk_hits": sum(n.disk_hits for n in resp.namespaces),
        "disk_failures": sum(n.disk_failures for n in resp.namespaces),
        "used_bytes": resp.used_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tier-gib", type=float, default=2.0)
    parser.add_argument("--disk-dir", default="", help="a disk tier in this directory")
    parser.add_argument("--disk-gib", type=float, default=4.0)
    args = parser.parse_args()
    emit = lambda row: print(json.dumps(row), flush=True)  # noqa: E731
    disk = int(args.disk_gib * 2**30) if args.disk_dir else 0
    asyncio.run(run_async(args.conversations, args.turns, int(args.tier_gib * 2**30), emit, args.disk_dir, disk))


if __name__ == "__main__":
    main()
