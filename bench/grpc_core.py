"""4 KiB handoffs with daemons on gRPC's core without its EventEngine, against gRPC's defaults.

Two pairs of same-host daemons in one run: one started with ``GRPC_EXPERIMENTS`` turning
gRPC's EventEngine client and listener off (its older poller instead), one with
``GRPC_EXPERIMENTS=`` (gRPC's own defaults). The engines are the same for both (the
harness's environment). Round by round, on
each pair: two unary echoes, a remote and a local 4 KiB handoff (offer + pull, as the engines
see them), and every tenth round 64 local and 64 remote handoffs in flight.

Run: ``python -m bench.grpc_core [--rounds 200]``; one JSON line per pair.
"""

from __future__ import annotations

import argparse
import json
import statistics

from .cluster import Cluster
from .grpc_cost import EVENT_ENGINE_OFF
from .lean import Bench

PAIRS = {"event_engine_off": {"GRPC_EXPERIMENTS": EVENT_ENGINE_OFF}, "grpc_defaults": {"GRPC_EXPERIMENTS": ""}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    with Cluster() as cluster:
        pairs = {
            name: Bench(cluster, f"core-{i}", env={"KVXFERD_SAME_HOST_DIRECT_READ": "true", **env})
            for i, (name, env) in enumerate(PAIRS.items())
        }
        figs: dict[str, dict[str, list[float]]] = {name: {} for name in pairs}
        for r in range(args.rounds + 5):
            for name, b in pairs.items():
                f = figs[name]
                e = b.small_local("echo", count=2)["seconds"]
                remote = b.handoff(b.small_p, b.small_remote, 1, 4096)
                local = b.handoff(b.small_p, b.small_local, 1, 4096)
                if r < 5:
                    continue  # warming up
                f.setdefault("echo2", []).append(e[0] + e[1])
                f.setdefault("remote", []).append(remote["offer_s"] + remote["pull_s"])
                f.setdefault("local", []).append(local["offer_s"] + local["pull_s"])
                if r % 10 == 5:
                    f.setdefault("in_flight_local", []).append(b.in_flight(b.small_local))
                    f.setdefault("in_flight_remote", []).append(b.in_flight(b.small_remote))
        for name, f in figs.items():
            med = {key: statistics.median(values) for key, values in f.items()}
            row = {"pair": name, **{f"{k}_p50_ms": round(med[k] * 1e3, 3) for k in ("echo2", "remote", "local")}}
            row |= {f"{k}_per_s": round(med[k]) for k in ("in_flight_local", "in_flight_remote")}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
