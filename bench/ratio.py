"""The remote-path target, measured fairly on a noisy machine: interleaved sends.

The plain UCXX one-buffer send (shared-memory buffers, as the pools use) runs between two
processes kept alive next to the daemons. Each round alternates one baseline send and one
remote ``b16`` handoff through two daemons, ``--iters`` of each (the order flips every pair),
so both see the same machine state: on a shared VM the memory bandwidth available drifts
from one second to the next, and no process starts or exits (freeing memory the host then
reclaims) between the two. The line printed gives every round's ratio and their median.

Run: ``python -m bench.ratio [--rounds 7] [--iters 4] [--daemon-args '--window 4']``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from .cluster import Cluster
from .ucx_baseline import BaselinePair
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
    with Cluster() as cluster, BaselinePair(w.request_bytes, args.memory) as baseline:
        daemon_args = tuple(args.daemon_args.split())
        paths = both_paths(cluster, w, SEED, "ratio", daemon_args=daemon_args)
        remote = next((p, d) for path, p, d in paths if path == "remote")
        # Steady state before the first round: endpoints made, pool pages and UCX caches warm.
        run_sequential(*remote, w, rng, WARMUP_HANDOFFS, warmup=0)
        for _ in range(args.rounds):
            base_s: list[float] = []
            ours_s: list[float] = []
            data_s: list[float] = []
            for i in range(args.iters):
                if i % 2 == 0:
                    base_s.append(baseline.send())
                run = run_sequential(*remote, w, rng, 1, warmup=0)
                ours_s.extend(run["latencies_s"])
                data_s.extend(run["data_plane_s"])
                if i % 2 == 1:
                    base_s.append(baseline.send())
            base, ours, data_plane = (w.request_bytes * len(t) / sum(t) / 1e9 for t in (base_s, ours_s, data_s))
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
