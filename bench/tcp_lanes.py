"""Host blocks over TCP only: TCP lanes against UCX's own TCP transport, same run.

Every daemon runs with ``UCX_TLS=tcp`` (a cluster without shared memory or RDMA between
nodes; direct reads off, as between two hosts). Daemon pairs: ``ucx-tcp`` (``tcp_lanes:
off``: UCX carries the chunks over TCP) and ``lanes-K`` (``tcp_lanes: auto``, which picks lanes
because UCX's transport to the peer is TCP, with K lanes). Per workload, rounds interleave
the pairs; each round is an offer and a timed pull of 1K tokens of Llama-3-8B-shaped KV
(128 MiB): ``b16`` (64 regions of 32 KiB per block, scattered) and ``contig`` (two 64 MiB
ranges, the chunks contiguous). The same run also times UCXX's own one-buffer tag send of
128 MiB between two processes over TCP (``bench.ucx_baseline``, ``UCX_TLS=tcp``): the ceiling
a single UCX message reaches. Reports GB/s medians, and each lane count over ``ucx-tcp`` and
over the UCXX send.

Run: ``python -m bench.tcp_lanes [--rounds 7] [--lanes 1,2,4]``; one JSON line per workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer_client import AsyncKvxferClient, HostBuffer, Layout, Pool

from .cluster import ROOT, Cluster

TCP_ONLY = {"KVXFERD_SAME_HOST_DIRECT_READ": "false", "UCX_TLS": "tcp"}
LAYERS, BLOCK_TOKENS, TOKENS = 32, 16, 1024
REGION_BYTES = BLOCK_TOKENS * 8 * 128 * 2
BYTES = TOKENS // BLOCK_TOKENS * 2 * LAYERS * REGION_BYTES
WORKLOADS = {
    # name: (layout, blocks offered)
    "b16": (Layout.paged_kv(num_layers=LAYERS, num_blocks=256, block_bytes=REGION_BYTES), TOKENS // BLOCK_TOKENS),
    "contig": (Layout.paged_kv(num_layers=1, num_blocks=128, block_bytes=1 << 20), 64),
}


async def _pool(client: AsyncKvxferClient, layout: Layout, fill: bool) -> Pool:
    buffers = [HostBuffer.create(s) for s in layout.buffer_sizes()]
    for i, buf in enumerate(buffers):
        buf.array()[:] = np.random.default_rng(i).integers(0, 256, buf.size, dtype=np.uint8) if fill else 0
    return await client.register_pool(buffers, layout)


def ucxx_tcp_gbps(nbytes: int, iters: int) -> float:
    """UCXX's one-buffer tag send over TCP between two processes (median GB/s)."""
    env = dict(os.environ, UCX_TLS="tcp", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "bench.ucx_baseline", "--bytes", str(nbytes), "--iters", str(iters)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["gbps_median"])


async def run_async(lanes: list[int], rounds: int, emit: Callable[[dict[str, Any]], None]) -> None:
    pairs = {"ucx-tcp": ("--tcp-lanes", "off")} | {
        f"lanes-{k}": ("--tcp-lanes", "auto", "--tcp-lane-count", str(k)) for k in lanes
    }
    with Cluster() as cluster:
        clients: list[AsyncKvxferClient] = []
        try:
            for name, (layout, n) in WORKLOADS.items():
                engines = {}
                for pair, args in pairs.items():
                    a = cluster.daemon(f"p-{pair}-{name}", *args, env=TCP_ONLY)
                    b = cluster.daemon(f"d-{pair}-{name}", *args, env=TCP_ONLY)
                    p = await AsyncKvxferClient(a.socket, engine_name="prefill").connect()
                    d = await AsyncKvxferClient(b.socket, engine_name="decode").connect()
                    clients += [p, d]
                    engines[pair] = (p, d, await _pool(p, layout, True), await _pool(d, layout, False))
                times: dict[str, list[float]] = {pair: [] for pair in pairs}
                transports: dict[str, str] = {}
                for r in range(rounds + 1):  # the first round warms up (endpoints, page faults)
                    for pair in pairs if r % 2 else reversed(list(pairs)):
                        p, d, src, dst = engines[pair]
                        first = (r % 2) * n  # alternate source blocks: no cache reuse between rounds
                        ticket = await p.offer(src, list(range(first, first + n)))
                        t0 = time.perf_counter()
                        result = await d.pull(ticket, dst, list(range(n)), timeout_s=120)
                        if r:
                            times[pair].append(time.perf_counter() - t0)
                        transports[pair] = result.transport
                        assert result.bytes == BYTES, result
                gbps = {pair: BYTES / statistics.median(t) / 1e9 for pair, t in times.items()}
                ceiling = ucxx_tcp_gbps(BYTES, 5)
                emit(
                    {
                        "workload": name,
                        "mib": BYTES / 2**20,
                        "ucxx_one_buffer_tcp_gbps": round(ceiling, 3),
                        **{f"{pair}_gbps": round(v, 3) for pair, v in gbps.items()},
                        **{f"lanes-{k}_vs_ucx_tcp": round(gbps[f"lanes-{k}"] / gbps["ucx-tcp"], 2) for k in lanes},
                        **{f"lanes-{k}_vs_ucxx_send": round(gbps[f"lanes-{k}"] / ceiling, 2) for k in lanes},
                        "transports": transports,
                    }
                )
        finally:
            for client in clients:
                await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--lanes", default="1,2,4")
    args = parser.parse_args()
    lanes = [int(k) for k in args.lanes.split(",")]
    asyncio.run(run_async(lanes, args.rounds, lambda row: print(json.dumps(row), flush=True)))


if __name__ == "__main__":
    main()
