"""``make demo``: two kvxferd daemons on loopback, real engines, verified handoffs.

Daemon A serves the prefill engine and a decode engine on the same node (local path);
daemon B serves a decode engine on "another node" (remote path, UCX). Every handoff moves a
Llama-3-8B-shaped 2048-token KV cache (32 layers x K/V x 128 blocks of 32 KiB = 8192
segments, 256 MiB) between random, out-of-order block ids, and every byte is checked.
Prints one JSON line per path and exits 0 only if every byte matched.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from .cluster import Cluster, _env
from .workloads import WORKLOADS, both_paths, run_sequential

SEED = 2024


def main() -> int:
    w = WORKLOADS["b16"]
    rng = np.random.default_rng(SEED)
    ok = True
    with Cluster() as cluster:
        for path, prefill, decode in both_paths(cluster, w, SEED, "demo"):
            row = run_sequential(prefill, decode, w, rng, iters=4, warmup=1, verify_seed=SEED)
            ok &= bool(row["verified"])
            print(
                json.dumps(
                    {
                        "path": path,
                        "request": w.description,
                        "gbps": round(row["gbps"], 3),
                        "handoffs_per_s": round(row["handoffs_per_s"], 2),
                        "p50_ms": round(row["p50_ms"], 1),
                        "transport": row["transport"],
                        "verified": row["verified"],
                    }
                ),
                flush=True,
            )
        ctl = subprocess.run(
            [sys.executable, "-m", "kvxfer_client._ctl", "--socket", cluster.daemons[0].socket, "transfers", "--all"],
            env=_env(),
            capture_output=True,
            text=True,
            check=False,
        )
        print("\nkvxferctl transfers --all (daemon A):\n" + ctl.stdout, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
