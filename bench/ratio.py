"""The remote-path target, measured fairly on a noisy machine: interleaved rounds.

Each round measures the plain UCXX one-buffer send (shared-memory buffers, as the pools use)
and then remote ``b16`` handoffs through two daemons, back to back, so both see the same
machine state; the line printed gives every round's ratio and their median.

Run: ``python -m bench.ratio [--rounds 7] [--iters 4] [--daemon-args '--window 4']``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from . import ucx_baseline
from .cluster import Cluster
from .workloads import WORKLOADS, both_paths, run_sequential

SEED = 11
WARMUP_HANDOFFS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--memory", choices=["shm", "numpy"], default="shm")
    parser.add_argument("--daemon-args", default="", help="extra kvxferd flags, e.g. '--chunk-bytes 8388608'")
    args = parser.parse_args()
    w = WORKLOADS["b16"]
    rng = np.random.default_rng(SEED)
    rounds = []
    with Cluster() as cluster:
        daemon_args = tuple(args.daemon_args.split())
        paths = both_paths(cluster, w, SEED, "ratio", daemon_args=daemon_args)
        remote = next((p, d) for path, p, d in paths if path == "remote")
        # Steady state before the first round: endpoints made, pool pages and UCX caches warm.
        run_sequential(*remote, w, rng, WARMUP_HANDOFFS, warmup=0)
        for _ in range(args.rounds):
            base = ucx_baseline.measure(w.request_bytes, args.iters, args.memory)["gbps_median"]
            run = run_sequential(*remote, w, rng, args.iters, warmup=1)
            ours, data_plane = run["gbps"], run["gbps_data_plane"]
            rounds.append(
                {
                    "baseline_gbps": round(base, 3),
                    "remote_gbps": round(ours, 3),
                    "ratio": round(ours / base, 3),
                    # The bytes' own time, without the handoff's gRPC exchanges: tells the
                    # data plane's share of a shortfall from the fixed cost's.
                    "data_plane_ratio": round(data_plane / base, 3),
                }
            )
    print(
        json.dumps(
            {
                "workload": "b16 remote vs plain UCXX one-buffer send",
                "baseline_memory": args.memory,
                "daemon_args": args.daemon_args,
                "rounds": rounds,
                "median_ratio": statistics.median(r["ratio"] for r in rounds),
                "median_data_plane_ratio": statistics.median(r["data_plane_ratio"] for r in rounds),
            }
        )
    )


if __name__ == "__main__":
    main()
