"""Engines' own memory against shared memory: the same handoffs, interleaved in one run.

A pool of the engine's own memory (numpy arrays here; torch CPU tensors are the same to the
daemon) is not mapped into the daemon: a local handoff between two such pools goes through the
daemon's scratch (``process_vm_readv`` in, ``process_vm_writev`` out: two passes where shared
memory takes one), and a remote one through staging on both daemons. This measures what that
costs next to shared-memory pools, on the same daemons, rounds alternating between the two
(the order flips each round) so both see the same machine state.

Run: ``python -m bench.process_memory [--workload b16] [--rounds 5] [--iters 3] [--memory torch]``. Prints one
line per round and a summary with each path's median ratio (process / shared memory).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from .cluster import Cluster
from .workloads import WORKLOADS, run_sequential

SEED = 13


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="b16", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--memory", choices=["numpy", "torch"], default="numpy", help="the engine-owned side")
    args = parser.parse_args()
    own = args.memory
    memories = ("host", own)  # the bench engine's names: shared memory, the engine's own heap
    w = WORKLOADS[args.workload]
    rng = np.random.default_rng(SEED)
    with Cluster() as cluster:
        a, b = cluster.daemon("pm-a"), cluster.daemon("pm-b")
        engines = {}
        for memory in memories:
            prefill = cluster.engine(a, f"prefill-{memory}")
            prefill("pool", shape=w.shape, seed=SEED, memory=memory)
            for path, daemon in (("local", a), ("remote", b)):
                decode = cluster.engine(daemon, f"decode-{memory}-{path}")
                decode("pool", shape=w.shape, memory=memory)
                run_sequential(prefill, decode, w, rng, 1, warmup=1, verify_seed=SEED)  # fault pages in, check
                engines[memory, path] = (prefill, decode)
        ratios: dict[str, list[float]] = {"local": [], "remote": []}
        gbps: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
        for r in range(args.rounds):
            order = memories if r % 2 == 0 else memories[::-1]
            got: dict[tuple[str, str], float] = {}
            for memory in order:
                for path in ("local", "remote"):
                    prefill, decode = engines[memory, path]
                    row = run_sequential(prefill, decode, w, rng, args.iters, warmup=0)
                    got[memory, path] = row["gbps"]
                    gbps[memory, path].append(row["gbps"])
            for path in ratios:
                ratios[path].append(got[own, path] / got["host", path])
            print(json.dumps({"round": r, **{f"{m}_{p}_gbps": v for (m, p), v in got.items()}}), flush=True)
        print(
            json.dumps(
                {
                    "summary": f"{w.name}: the engine's own memory ({own}) / shared memory, same daemons, same run",
                    **{f"{m}_{p}_gbps_median": statistics.median(v) for (m, p), v in gbps.items()},
                    **{f"ratio_{p}_median": statistics.median(v) for p, v in ratios.items()},
                    "ratios": ratios,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
