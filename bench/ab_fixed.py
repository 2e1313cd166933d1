"""A 4 KiB handoff's fixed cost on two trees' daemons, round by round in one run.

This VM's speed swings by 2x within minutes, and a ratio to gRPC echoes only partly hides it:
two runs of ``bench.lean`` minutes apart differ by more than most single changes to the hot
path. So this runs daemons of two checkouts side by side (``--base``, e.g. a ``git worktree``
of the commit before a change, and this tree), two pairs each, and alternates between them
every round. The engines are this tree's. Per round and per tree: two unary echoes (health
checks on the daemon's engine socket), a remote 4 KiB handoff (direct reads) and a local
one, as the engines see them (offer + pull). Medians, and each handoff against two echoes of
the same tree's daemons. ``--ucx`` moves the remote handoffs over UCX (direct reads off);
``--in-flight`` also times 64 remote handoffs at once each round (per second, median; the
serial figures of such a run carry what each batch leaves behind, and are not comparable);
``--size`` also a remote 16 MiB and a remote 256 MiB handoff (b16 pools), and the first's
rate against the second's (``bench.lean``'s size target).

Run: ``git worktree add /tmp/base <rev> && python -m bench.ab_fixed --base /tmp/base
[--rounds 150]``; one JSON line per tree.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import numpy as np

from .cluster import ROOT, Cluster, EngineProcess
from .lean import B16, MIB, SMALL

#: The remote path: same-host direct reads (the default), or UCX (``--ucx``), as between hosts.
DIRECT, UCX = {"KVXFERD_SAME_HOST_DIRECT_READ": "true"}, {"KVXFERD_SAME_HOST_DIRECT_READ": "false"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a checkout whose daemons are compared with this tree's")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--ucx", action="store_true", help="remote handoffs over UCX (direct reads off)")
    parser.add_argument("--in-flight", action="store_true", help="also 64 remote 4 KiB handoffs at once, per second")
    parser.add_argument("--size", action="store_true", help="also remote 16 MiB and 256 MiB handoffs, and their rates")
    args = parser.parse_args()
    env = UCX if args.ucx else DIRECT
    rng = np.random.default_rng(3)
    with Cluster() as cluster:
        trees: dict[str, tuple[EngineProcess, ...]] = {}
        big: dict[str, tuple[EngineProcess, EngineProcess]] = {}
        for name, root in (("base", args.base), ("this", ROOT)):
            prefix = ["env", "-C", root]  # ``python -m kvxferd`` imports from its working directory
            a = cluster.daemon(f"{name}-a", env=env, prefix=prefix)
            b = cluster.daemon(f"{name}-b", env=env, prefix=prefix)
            # The prefill engine and a local decode engine on daemon a, a remote one on b.
            roles = ((a, "prefill", 1), (a, "local", None), (b, "remote", None))
            trees[name] = tuple(_engine(cluster, d, f"{name}-{role}", seed) for d, role, seed in roles)
            if args.size:
                big[name] = (
                    _engine(cluster, a, f"{name}-big-prefill", 2, B16),
                    _engine(cluster, b, f"{name}-big", None, B16),
                )
        figs: dict[str, dict[str, list[float]]] = {name: {"echo2": [], "local": [], "remote": []} for name in trees}
        for f in figs.values():
            f |= {"in_flight": []} if args.in_flight else {}
            f |= {"mid": [], "big": []} if args.size else {}
        for r in range(args.rounds + 5):
            for name, (prefill, local, remote) in trees.items():
                echo = local("echo", count=2)["seconds"]
                far, near = _handoff(rng, prefill, remote), _handoff(rng, prefill, local)
                if r >= 5:  # warm
                    f = figs[name]
                    f["echo2"].append(echo[0] + echo[1])
                    f["remote"].append(far)
                    f["local"].append(near)
                    if args.in_flight:
                        f["in_flight"].append(_in_flight(rng, prefill, remote))
                    if args.size:
                        f["mid"].append(_handoff(rng, *big[name], blocks=8, of=256))  # 16 MiB
                        f["big"].append(_handoff(rng, *big[name], blocks=128, of=256))  # 256 MiB
        for name, f in figs.items():
            med = {k: statistics.median(v) for k, v in f.items()}
            row: dict[str, Any] = {
                "tree": args.base if name == "base" else ROOT,
                "remote_path": "ucx" if args.ucx else "direct",
            }
            row |= {f"{k}_p50_ms": round(v * 1e3, 3) for k, v in med.items() if k != "in_flight"}
            if "in_flight" in med:
                row["in_flight_per_s"] = round(med["in_flight"], 1)
            if "big" in med:  # rates of the medians: 16 MiB's against 256 MiB's
                row["mid_of_big_rate"] = round((16 * MIB / med["mid"]) / (256 * MIB / med["big"]), 3)
            row |= {f"{k}_vs_echo2": round(med[k] / med["echo2"], 3) for k in ("local", "remote")}
            print(json.dumps(row), flush=True)


def _engine(cluster: Cluster, daemon: Any, name: str, seed: int | None, shape: dict[str, int] = SMALL) -> EngineProcess:
    engine = cluster.engine(daemon, name)
    engine("pool", shape=shape, seed=seed)
    return engine


def _handoff(
    rng: np.random.Generator, prefill: EngineProcess, decode: EngineProcess, blocks: int = 1, of: int = 4096
) -> float:
    """One offer of ``blocks`` blocks (of a pool of ``of``) and its pull, as the engines timed them."""
    src, dst = rng.permutation(of)[:blocks].tolist(), rng.permutation(of)[:blocks].tolist()
    offered = prefill("offer", requests=[src])
    [res] = decode("pull", pulls=[[offered["tickets"][0], dst]])["results"]
    if not res["ok"]:
        raise RuntimeError(f"pull failed: {res}")
    return float(offered["offer_s"] + res["latency_s"])


def _in_flight(rng: np.random.Generator, prefill: EngineProcess, decode: EngineProcess, n: int = 64) -> float:
    """Handoffs per second: ``n`` 4 KiB offers at once, then their ``n`` pulls at once."""
    src, dst = rng.permutation(4096)[:n].tolist(), rng.permutation(4096)[:n].tolist()
    offered = prefill("offer", requests=[[i] for i in src])
    pulled = decode("pull", pulls=[[t, [d]] for t, d in zip(offered["tickets"], dst, strict=True)])
    if not all(r["ok"] for r in pulled["results"]):
        raise RuntimeError("a pull in flight failed")
    return float(n / (offered["offer_s"] + pulled["wall_s"]))


if __name__ == "__main__":
    main()
