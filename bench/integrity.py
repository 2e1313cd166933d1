"""What block checksums cost: handoff time with ``integrity`` off, sampled and full, same run.

Three daemon pairs, one per mode (the offering daemon's mode decides what is summed; the
decode daemon checks what it is sent). Per request size, rounds interleave the modes: each
round is an offer and a pull of Llama-3-8B-shaped host blocks (32 layers, 8 KV heads of 128,
bf16, 16-token blocks: 2 MiB a block), timed from before the offer to the pull's answer,
remote over UCX (direct reads off, as between two hosts) and local (both engines on the
offering daemon). Reports the medians and ``sampled/off``, ``full/off``.

Targets (issue 24): sampled within 3% of off, full within 15%, on host pools.

Run: ``python -m bench.integrity [--rounds 15] [--tokens 1024,2048]``; one JSON line per
(size, path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer_client import AsyncKvxferClient, HostBuffer, Layout, Pool

from .cluster import Cluster

MODES = ("off", "sampled", "full")
LAYERS, BLOCK_TOKENS = 32, 16
REGION_BYTES = BLOCK_TOKENS * 8 * 128 * 2
UCX_ONLY = {"KVXFERD_SAME_HOST_DIRECT_READ": "false"}


async def _pool(client: AsyncKvxferClient, blocks: int, fill: bool) -> Pool:
    layout = Layout.paged_kv(num_layers=LAYERS, num_blocks=blocks, block_bytes=REGION_BYTES)
    buffers = [HostBuffer.create(s) for s in layout.buffer_sizes()]
    for i, buf in enumerate(buffers):
        buf.array()[:] = np.random.default_rng(i).integers(0, 256, buf.size, dtype=np.uint8) if fill else 0
    return await client.register_pool(buffers, layout)


async def run_async(tokens: list[int], rounds: int, emit: Callable[[dict[str, Any]], None]) -> None:
    blocks = max(tokens) // BLOCK_TOKENS
    with Cluster() as cluster:
        daemons = {m: tuple(cluster.daemon(f"{r}-{m}", "--integrity", m, env=UCX_ONLY) for r in "pd") for m in MODES}
        engines: dict[str, tuple[AsyncKvxferClient, AsyncKvxferClient, AsyncKvxferClient]] = {}
        pools: dict[str, tuple[Pool, Pool, Pool]] = {}
        for m, (a, b) in daemons.items():
            p = await AsyncKvxferClient(a.socket, engine_name=f"prefill-{m}").connect()
            d = await AsyncKvxferClient(b.socket, engine_name=f"decode-{m}").connect()
            local = await AsyncKvxferClient(a.socket, engine_name=f"local-{m}").connect()
            engines[m] = (p, d, local)
            pools[m] = (
                await _pool(p, blocks * 2, True),
                await _pool(d, blocks, False),
                await _pool(local, blocks, False),
            )
        try:
            for n_tokens in tokens:
                n = n_tokens // BLOCK_TOKENS
                times: dict[tuple[str, str], list[float]] = {
                    (m, path): [] for m in MODES for path in ("remote", "local")
                }
                for r in range(rounds + 1):  # the first round warms up (endpoints, page faults)
                    for path in ("remote", "local"):
                        for m in MODES if r % 2 else reversed(MODES):
                            p, d, local = engines[m]
                            src, dst, dst_local = pools[m]
                            puller, into = (d, dst) if path == "remote" else (local, dst_local)
                            first = (r % 2) * n  # alternate source blocks: no cache reuse between rounds
                            t0 = time.perf_counter()
                            ticket = await p.offer(src, list(range(first, first + n)))
                            await puller.pull(ticket, into, list(range(n)), timeout_s=120)
                            if r:
                                times[(m, path)].append(time.perf_counter() - t0)
                for path in ("remote", "local"):
                    med = {m: statistics.median(times[(m, path)]) for m in MODES}
                    emit(
                        {
                            "tokens": n_tokens,
                            "mib": n * 2 * LAYERS * REGION_BYTES / 2**20,
                            "path": path,
                            **{f"{m}_ms": round(med[m] * 1e3, 2) for m in MODES},
                            "sampled_vs_off": round(med["sampled"] / med["off"], 3),
                            "full_vs_off": round(med["full"] / med["off"], 3),
                        }
                    )
        finally:
            for trio in engines.values():
                for client in trio:
                    await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", default="1024,2048")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    asyncio.run(run_async(tokens, args.rounds, lambda row: print(json.dumps(row), flush=True)))


if __name__ == "__main__":
    main()
