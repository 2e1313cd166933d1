"""kvxfer host-memory benchmark: local and remote paths next to a plain UCXX baseline.

Run: ``python -m bench [--iters 8] [--workloads b16,b128,contig,small,sliced,lean,integrity,tcp_lanes,tier]
[--out results.json]``
(``ttft``, not in the default set, adds ``bench/ttft.py``: prefill start to decode ready for
pull, push and layer-wise push, on two 2 GiB Llama-8B-shaped pools at its largest size).
Prints one JSON line per (workload, path) and a summary line with the remote/baseline ratio;
``sliced`` (``bench/sliced.py``) adds remapped handoffs (other TP, head order, block size)
with their ratio to plain ones of the same bytes; ``lean`` (``bench/lean.py``) the fixed cost
of a handoff against same-run gRPC echoes, offers under load, CPU per GB, and contention;
``integrity`` (``bench/integrity.py``) what the default block checksums cost on the
workloads above, against off, same run; ``tcp_lanes`` (``bench/tcp_lanes.py``) host blocks over TCP lanes
against UCX's own TCP; ``tier`` (``bench/tier.py``) multi-turn conversations through the
node's KV tier, memory only and with a disk below.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile

import numpy as np

from . import integrity, lean, sliced, tcp_lanes, tier, ttft, ucx_baseline
from .cluster import Cluster
from .workloads import WORKLOADS, both_paths, run_concurrent, run_sequential

SEED = 7


#: The workloads measure the UCX data plane, which daemons on different hosts use: here both
#: daemons share one host, where they would read each other's memory directly by default.
#: ``lean`` measures both.
UCX_ONLY = {"KVXFERD_SAME_HOST_DIRECT_READ": "false"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--workloads", default="b16,b128,contig,small,sliced,lean,integrity,tcp_lanes,tier")
    parser.add_argument("--small-count", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", help="also write every line into this JSON file")
    args = parser.parse_args()
    rows = []

    def emit(row: dict[str, object]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    baselines = {}
    for memory in ("shm", "numpy"):
        baselines[memory] = ucx_baseline.measure(WORKLOADS["b16"].request_bytes, max(args.iters, 5), memory)
        emit({"baseline": "ucxx-one-buffer", **baselines[memory]})
    rng = np.random.default_rng(SEED)
    for name in args.workloads.split(","):
        if name == "sliced":
            sliced.run(max(args.iters, 16), emit)
            continue
        if name == "lean":
            lean.run(max(args.iters, 20), 1, lambda row: emit({"workload": "lean", **row}))
            continue
        if name == "integrity":
            integrity.run(
                ["b16", "b128", "contig", "small"],
                max(args.iters, 9),
                3,
                False,
                lambda row: emit({"part": "integrity", **row}),
            )
            continue
        if name == "tcp_lanes":
            asyncio.run(
                tcp_lanes.run_async([1, 2, 4], max(args.iters, 5), lambda row: emit({"workload": "tcp_lanes", **row}))
            )
            continue
        if name == "tier":
            with tempfile.TemporaryDirectory(dir="/var/tmp") as disk:  # a disk, not tmpfs, where there is one
                for gib, disk_gib in ((2, 0), (1, 4)):
                    asyncio.run(
                        tier.run_async(
                            8,
                            6,
                            gib << 30,
                            lambda row: emit({"workload": "tier", **row}),
                            disk if disk_gib else "",
                            disk_gib << 30,
                        )
                    )
            continue
        if name == "ttft":
            tokens = [256, 1024, 4096, 16384]
            asyncio.run(ttft.run_async(tokens, 5, 20_000.0, False, lambda row: emit({"workload": "ttft", **row})))
            continue
        w = WORKLOADS[name]
        with Cluster() as c:
            for path, prefill, decode in both_paths(c, w, SEED, "bench", env=UCX_ONLY):
                if name == "small":
                    row = run_concurrent(prefill, decode, w, rng, args.small_count, args.concurrency)
                else:
                    row = run_sequential(prefill, decode, w, rng, args.iters)
                emit({"path": path, **row})
    by = {(r.get("workload"), r.get("path")): r for r in rows if "part" not in r}
    for name in ("b16", "contig"):
        remote = by.get((name, "remote"))
        if remote:
            emit(
                {
                    "summary": f"remote {name} vs plain UCXX one-buffer send of the same bytes, same run",
                    "remote_gbps": remote["gbps"],
                    **{f"ratio_vs_{m}": remote["gbps"] / b["gbps_median"] for m, b in baselines.items()},
                }
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=2)
    sys.exit(0)


if __name__ == "__main__":
    main()
