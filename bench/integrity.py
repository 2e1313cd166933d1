"""What block checksums cost, on the workloads of ``python -m bench``, same run.

One daemon pair per mode, engines in their own processes as in ``python -m bench``: ``off``,
``sampled`` (the default), a second ``off`` pair (``off2``: what two identical pairs differ
by, the noise floor of the wall-time ratio on this machine) and, with ``--full``, ``full``.
Per workload (b16, b128, contig, small) and path (remote over UCX with direct reads off, as
between two hosts; local), rounds interleave the modes (their order reversed every other
round): each round is ``--per-round`` sequential handoffs (offer + pull, as ``run_sequential``
times them) or, for ``small``, 256 handoffs 64 in flight. Reports per mode the median handoff
time (``small``: handoffs per second) and the ratios to ``off``.

The wall-time ratio cannot resolve a cost of a few percent on a 2-core VM, so the cost is
also measured directly: the daemons' ``kvxfer_integrity_seconds_total`` (CPU time of every
step: the digest at the offer, the check where the blocks land, the source summed again when
that fails), per handoff; what ``sampled`` adds to ``off`` (whose steps run too, with nothing
to sum) as a share of the ``off`` handoff's time (``added_vs_time``) and of both daemons' CPU
time per ``off`` handoff (``added_vs_cpu``, from ``process_cpu_seconds_total``).

Run: ``python -m bench.integrity [--rounds 9] [--workloads b16,b128,contig,small] [--full]``;
one JSON line per (workload, path).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from .cluster import Cluster, Daemon, EngineProcess
from .workloads import WORKLOADS, Workload, run_concurrent, run_sequential

UCX_ONLY = {"KVXFERD_SAME_HOST_DIRECT_READ": "false"}
SPENT, CPU = "kvxfer_integrity_seconds_total", "process_cpu_seconds_total"
SMALL_ROUND, SMALL_IN_FLIGHT = 256, 64


class Rig:
    """One mode's daemon pair and engines: a seeded prefill pool, a decode pool per path."""

    def __init__(self, cluster: Cluster, mode: str, setting: str, w: Workload) -> None:
        self.daemons: tuple[Daemon, Daemon] = (
            cluster.daemon(f"p-{w.name}-{mode}", "--integrity", setting, env=UCX_ONLY),
            cluster.daemon(f"d-{w.name}-{mode}", "--integrity", setting, env=UCX_ONLY),
        )
        self.prefill = cluster.engine(self.daemons[0], f"prefill-{mode}")
        self.prefill("pool", shape=w.shape, seed=7, memory="host")
        self.decode: dict[str, EngineProcess] = {}
        for path, daemon in (("remote", self.daemons[1]), ("local", self.daemons[0])):
            self.decode[path] = cluster.engine(daemon, f"decode-{path}-{mode}")
            self.decode[path]("pool", shape=w.shape, memory="host")

    def spent(self) -> tuple[float, float]:
        """The daemons' integrity seconds and their whole CPU seconds, so far."""
        return sum(d.metric(SPENT) for d in self.daemons), sum(d.metric(CPU) for d in self.daemons)


def measure(w: Workload, path: str, rigs: dict[str, Rig], rounds: int, per_round: int) -> dict[str, Any]:
    """Interleaved rounds on one path; per mode its figures and its integrity seconds."""
    rng = np.random.default_rng(11)
    values: dict[str, list[float]] = {m: [] for m in rigs}
    handoffs = dict.fromkeys(rigs, 0)
    spent_before = dict.fromkeys(rigs, (0.0, 0.0))
    for r in range(rounds + 1):  # the first round warms up (endpoints, page faults)
        for mode in list(rigs) if r % 2 else reversed(list(rigs)):
            rig = rigs[mode]
            if w.name == "small":
                row = run_concurrent(rig.prefill, rig.decode[path], w, rng, SMALL_ROUND, SMALL_IN_FLIGHT)
                sample, n = [row["handoffs_per_s"]], SMALL_ROUND
            else:
                row = run_sequential(rig.prefill, rig.decode[path], w, rng, per_round, warmup=0)
                sample, n = row["latencies_s"], per_round
            if r == 0:
                spent_before[mode] = rig.spent()
                continue
            values[mode] += sample
            handoffs[mode] += n
    spent, cpu = {}, {}
    for m, rig in rigs.items():
        now = rig.spent()
        spent[m] = (now[0] - spent_before[m][0]) / max(1, handoffs[m])
        cpu[m] = (now[1] - spent_before[m][1]) / max(1, handoffs[m])
    return _row(w, path, values, spent, cpu)


def _row(
    w: Workload, path: str, values: dict[str, list[float]], spent: dict[str, float], cpu: dict[str, float]
) -> dict[str, Any]:
    med = {m: statistics.median(v) for m, v in values.items()}
    small = w.name == "small"
    # Time per handoff, whichever way it was measured (small: the batch's rate).
    per_handoff = {m: (1.0 / med[m] if small else med[m]) for m in med}
    row: dict[str, Any] = {"workload": w.name, "path": path, "request_bytes": w.request_bytes}
    for m in med:
        row[f"{m}_{'per_s' if small else 'ms'}"] = round(med[m] if small else med[m] * 1e3, 3)
        if m != "off":
            row[f"{m}_vs_off"] = round(per_handoff[m] / per_handoff["off"], 4)
        row[f"{m}_integrity_us"] = round(spent[m] * 1e6, 1)
        row[f"{m}_daemon_cpu_us"] = round(cpu[m] * 1e6, 1)
    # What sampled adds (its checks less the bare steps off runs too), against the handoff
    # time and against the daemons' CPU time of an off handoff.
    added = spent["sampled"] - spent["off"]
    row["added_vs_time"] = round(added / per_handoff["off"], 5)
    row["added_vs_cpu"] = round(added / cpu["off"], 5)
    return row


def run(workloads: list[str], rounds: int, per_round: int, full: bool, emit: Callable[[dict[str, Any]], None]) -> None:
    modes = {"off": "off", "sampled": "sampled", "off2": "off"} | ({"full": "full"} if full else {})
    for name in workloads:
        w = WORKLOADS[name]
        with Cluster() as cluster:
            rigs = {mode: Rig(cluster, mode, setting, w) for mode, setting in modes.items()}
            for path in ("remote", "local"):
                emit(measure(w, path, rigs, rounds, per_round))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--workloads", default="b16,b128,contig,small")
    parser.add_argument("--full", action="store_true", help="also a pair with integrity full")
    args = parser.parse_args()
    emit: Callable[[dict[str, Any]], None] = lambda row: print(json.dumps(row), flush=True)  # noqa: E731
    run(args.workloads.split(","), args.rounds, args.per_round, args.full, emit)


if __name__ == "__main__":
    main()
