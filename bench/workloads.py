"""Benchmark workloads and the runner shared by ``python -m bench`` and ``make demo``.

Shapes follow Llama-3-8B (32 layers, 8 KV heads, head dim 128, 2-byte elements): one
16-token block of one layer's K (or V) is 16 x 8 x 128 x 2 = 32 KiB.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cluster import Cluster, EngineProcess


@dataclass(frozen=True)
class Workload:
    name: str
    layers: int
    block_bytes: int
    blocks_per_request: int
    pool_blocks: int
    description: str

    @property
    def shape(self) -> dict[str, int]:
        return {"layers": self.layers, "blocks": self.pool_blocks, "block_bytes": self.block_bytes}

    @property
    def request_bytes(self) -> int:
        return self.layers * 2 * self.block_bytes * self.blocks_per_request

    @property
    def segments(self) -> int:
        return self.layers * 2 * self.blocks_per_request


WORKLOADS = {
    "b16": Workload("b16", 32, 32 << 10, 128, 256, "Llama-3-8B, 2048 tokens, block 16: 8192 x 32 KiB = 256 MiB"),
    "b128": Workload("b128", 32, 256 << 10, 16, 32, "Llama-3-8B, 2048 tokens, block 128: 1024 x 256 KiB = 256 MiB"),
    "contig": Workload("contig", 1, 128 << 20, 1, 2, "one contiguous K and V: 2 x 128 MiB"),
    "small": Workload("small", 1, 2 << 10, 1, 8192, "4 KiB requests (2 x 2 KiB), many at once"),
}


def both_paths(
    cluster: Cluster,
    w: Workload,
    seed: int,
    prefix: str,
    memory: str = "host",
    daemon_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, EngineProcess, EngineProcess]]:
    """Daemons A and B; a prefill engine on A with a pool filled from ``seed``; then, for the
    local path a decode engine on A and for the remote path one on B. ``memory``: "host" or
    "gpu" pools on both sides."""
    a, b = cluster.daemon(f"{prefix}-a", *daemon_args, env=env), cluster.daemon(f"{prefix}-b", *daemon_args, env=env)
    prefill = cluster.engine(a, "prefill")
    prefill("pool", shape=w.shape, seed=seed, memory=memory)
    for path, daemon in (("local", a), ("remote", b)):
        decode = cluster.engine(daemon, f"decode-{path}")
        decode("pool", shape=w.shape, memory=memory)
        yield path, prefill, decode


def random_requests(rng: np.random.Generator, w: Workload, count: int) -> list[tuple[list[int], list[int]]]:
    """(source ids, destination ids) pairs: random, out of order, non-contiguous."""
    out = []
    for _ in range(count):
        src = rng.permutation(w.pool_blocks)[: w.blocks_per_request].tolist()
        dst = rng.permutation(w.pool_blocks)[: w.blocks_per_request].tolist()
        out.append((src, dst))
    return out


def run_sequential(
    prefill: EngineProcess,
    decode: EngineProcess,
    w: Workload,
    rng: np.random.Generator,
    iters: int,
    warmup: int = 2,
    verify_seed: int | None = None,
    verify_count: int | None = None,
) -> dict[str, Any]:
    """One handoff at a time: offer, pull, (verify the first ``verify_count``, default all);
    returns throughput and latency."""
    latencies, harness, daemon_s, data_s, device_s, offer_s, pull_s = [], [], [], [], [], [], []
    transports: set[str] = set()
    verified = True
    for i in range(warmup + iters):
        ((src, dst),) = random_requests(rng, w, 1)
        t0 = time.perf_counter()
        offered = prefill("offer", requests=[src])
        ticket = offered["tickets"][0]
        res = decode("pull", pulls=[[ticket, dst]])["results"][0]
        elapsed = time.perf_counter() - t0
        if not res["ok"]:
            raise RuntimeError(f"pull failed: {res}")
        prefill("released", offer_ids=[ticket["offer_id"]])
        if verify_seed is not None and (verify_count is None or i < verify_count):
            verified &= decode("verify", seed=verify_seed, pairs=[[src, dst]])["verified"]
        if i >= warmup:
            # kvxfer's part: the offer call in the prefill engine plus the pull call in the
            # decode engine (handing the ticket over is the serving framework's job).
            latencies.append(offered["offer_s"] + res["latency_s"])
            harness.append(elapsed)
            offer_s.append(offered["offer_s"])
            pull_s.append(res["latency_s"])
            daemon_s.append(res["daemon_s"])
            data_s.append(res.get("data_plane_s", 0.0))
            device_s.append(res.get("device_s", 0.0))
            transports.add(res["transport"])
    total = w.request_bytes * iters
    return {
        "workload": w.name,
        "request_bytes": w.request_bytes,
        "segments": w.segments,
        "handoffs": iters,
        "gbps": total / sum(latencies) / 1e9,
        "gbps_daemon": total / sum(daemon_s) / 1e9,
        "gbps_data_plane": total / sum(data_s) / 1e9 if all(data_s) else None,
        "gbps_device": total / sum(device_s) / 1e9 if all(device_s) else None,
        "handoffs_per_s": iters / sum(latencies),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": float(np.percentile(latencies, 99)) * 1e3,
        "harness_p50_ms": statistics.median(harness) * 1e3,
        "offer_p50_ms": statistics.median(offer_s) * 1e3,
        "pull_p50_ms": statistics.median(pull_s) * 1e3,
        "daemon_p50_ms": statistics.median(daemon_s) * 1e3,
        "daemon_p99_ms": float(np.percentile(daemon_s, 99)) * 1e3,
        "transport": ",".join(sorted(transports)),
        "verified": bool(verified) if verify_seed is not None else None,
        "latencies_s": latencies,
        "data_plane_s": data_s,
    }


def run_concurrent(
    prefill: EngineProcess,
    decode: EngineProcess,
    w: Workload,
    rng: np.random.Generator,
    total: int,
    concurrency: int,
    verify_seed: int | None = None,
) -> dict[str, Any]:
    """``concurrency`` handoffs in flight at a time; offers are made per batch."""
    pull_s = 0.0
    latencies: list[float] = []
    transports: set[str] = set()
    verified = True
    done = 0
    while done < total:
        n = min(concurrency, total - done)
        # Unique destinations inside a batch: concurrent pulls must not write the same block.
        dst_all = rng.permutation(w.pool_blocks)
        pairs = [
            (
                rng.permutation(w.pool_blocks)[: w.blocks_per_request].tolist(),
                dst_all[i * w.blocks_per_request : (i + 1) * w.blocks_per_request].tolist(),
            )
            for i in range(n)
        ]
        tickets = prefill("offer", requests=[p[0] for p in pairs])["tickets"]
        reply = decode("pull", pulls=[[t, p[1]] for t, p in zip(tickets, pairs, strict=True)])
        failed = [r for r in reply["results"] if not r["ok"]]
        if failed:
            raise RuntimeError(f"{len(failed)} pulls failed, first: {failed[0]}")
        pull_s += reply["wall_s"]
        latencies += [r["latency_s"] for r in reply["results"]]
        transports |= {r["transport"] for r in reply["results"]}
        prefill("released", offer_ids=[t["offer_id"] for t in tickets])
        if verify_seed is not None:
            verified &= decode("verify", seed=verify_seed, pairs=pairs)["verified"]
        done += n
    return {
        "workload": w.name,
        "request_bytes": w.request_bytes,
        "handoffs": total,
        "concurrency": concurrency,
        "handoffs_per_s": total / pull_s,
        "gbps": total * w.request_bytes / pull_s / 1e9,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": float(np.percentile(latencies, 99)) * 1e3,
        "transport": ",".join(sorted(transports)),
        "verified": bool(verified) if verify_seed is not None else None,
    }
