"""What a handoff costs beyond its bytes: fixed cost, offers under load, CPU per GB, contention.

Two daemons on this host (host pools), engines in their own processes, everything measured
round by round in one run so that the machine's drift hits every figure alike:

* ``fixed``: a 4 KiB handoff (offer in the prefill engine + pull in the decode engine), local
  and remote, against two gRPC unary echoes (health checks on the daemon's engine socket);
  beside it, not a target, a remote one whose ticket is handed out before the offer's answer
  (``new_ticket``, as vLLM's connector does: the offer goes off the path);
* every remote figure for two pairs of same-host daemons: with direct reads (the default:
  the decode daemon reads the offered blocks itself) and without (UCX's shared memory);
* ``size``: remote GB/s of a 16 MiB request (about 128 tokens of Llama-3-8B KV) against a
  256 MiB one, and the most that ratio can be given the same run's 4 KiB fixed cost
  (``bound``: only a smaller fixed cost raises it);
* ``offers``: an offer's latency idle, and with 64 remote pulls of 4 MiB in flight on the
  offering daemon;
* ``cpu``: each daemon's CPU seconds per GB moved (256 MiB remote handoffs); ``idle``: the
  daemons' CPU use while idle with live peers;
* ``contended``: 256 MiB remote GB/s quiet and with ``--busy`` busy-looping processes beside
  the daemons, over the same-host transport UCX picks between two daemons here and over TCP
  (a second pair of daemons with ``UCX_TLS=tcp,self``, as two hosts without RDMA use);
* ``inflight``: 4 KiB handoffs per second with 64 in flight (64 offers at once, then their
  64 pulls at once, end to end in the engines), local and remote, against pairs of unary
  echoes per second with 64 echoes in flight;
* ``targets``: each of the performance targets (docs/benchmarks.md) with this run's figure.

Run: ``python -m bench.lean [--rounds 30] [--busy 1]``; one JSON line per figure (``python
-m bench`` runs it as workload ``lean``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .cluster import Cluster, Daemon, EngineProcess

TICK = os.sysconf("SC_CLK_TCK")
SMALL = {"layers": 1, "blocks": 4096, "block_bytes": 2 << 10}  # 4 KiB a block (K and V)
B16 = {"layers": 32, "blocks": 256, "block_bytes": 32 << 10}  # 2 MiB a block (32 layers x K, V)
MIB = 1 << 20


def cpu_seconds(daemon: Daemon) -> float:
    assert daemon.proc is not None
    with open(f"/proc/{daemon.proc.pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1e3


class Bench:
    def __init__(self, cluster: Cluster, tag: str = "lean", env: dict[str, str] | None = None) -> None:
        self.a, self.b = cluster.daemon(f"{tag}-a", env=env), cluster.daemon(f"{tag}-b", env=env)
        self.rng = np.random.default_rng(3)
        self.transport = ""

        def engine(daemon: Daemon, name: str, shape: dict[str, int], seed: int | None = None) -> EngineProcess:
            e = cluster.engine(daemon, f"{tag}-{name}")
            e("pool", shape=shape, seed=seed)
            return e

        self.small_p = engine(self.a, "small-prefill", SMALL, seed=1)
        self.small_local = engine(self.a, "small-decode-local", SMALL)
        self.small_remote = engine(self.b, "small-decode-remote", SMALL)
        self.big_p = engine(self.a, "big-prefill", B16, seed=2)
        self.big_remote = engine(self.b, "big-decode-remote", B16)

    def handoff(
        self, prefill: EngineProcess, decode: EngineProcess, blocks: int, pool_blocks: int, early: bool = False
    ) -> dict[str, float]:
        """One offer and its pull: the engines' own times (offer_s, pull_s) and the daemon's.
        ``early``: the ticket is handed out before the offer's answer (vLLM's connector)."""
        src = self.rng.permutation(pool_blocks)[:blocks].tolist()
        dst = self.rng.permutation(pool_blocks)[:blocks].tolist()
        offered = prefill("offer", requests=[src], early=early)
        [res] = decode("pull", pulls=[[offered["tickets"][0], dst]])["results"]
        if not res["ok"]:
            raise RuntimeError(f"pull failed: {res}")
        self.transport = res["transport"]
        return {"offer_s": offered["offer_s"], "pull_s": res["latency_s"], "daemon_s": res["daemon_s"]}

    def in_flight(self, decode: EngineProcess, n: int = 64) -> float:
        """Handoffs per second, ``n`` 4 KiB offers at once and then their ``n`` pulls at once."""
        src, dst = self.rng.permutation(4096)[:n].tolist(), self.rng.permutation(4096)[:n].tolist()
        offered = self.small_p("offer", requests=[[i] for i in src])
        pulled = decode("pull", pulls=[[t, [d]] for t, d in zip(offered["tickets"], dst, strict=True)])
        if not all(r["ok"] for r in pulled["results"]):
            raise RuntimeError("a pull in flight failed")
        return float(n / (offered["offer_s"] + pulled["wall_s"]))

    def offers_under_load(self, inflight: int) -> list[float]:
        """Offer latencies on daemon a while ``inflight`` remote pulls of 4 MiB run from it."""
        tickets = self.big_p("offer", requests=[self.rng.permutation(256)[:2].tolist() for _ in range(inflight)])
        pulls = [[t, [(2 * i) % 256, (2 * i + 1) % 256]] for i, t in enumerate(tickets["tickets"])]
        done = threading.Event()
        result: dict[str, Any] = {}

        def pull_all() -> None:
            result.update(self.big_remote("pull", pulls=pulls))
            done.set()

        runner = threading.Thread(target=pull_all)
        runner.start()
        latencies = []
        while not done.is_set():
            latencies.append(self.small_p("offer", requests=[[int(self.rng.integers(4096))]])["offer_s"])
        runner.join()
        if not all(r["ok"] for r in result["results"]):
            raise RuntimeError("a pull under load failed")
        return latencies[1:-1] or latencies  # the first and last may see no load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--busy", type=int, default=1, help="busy-looping processes in the contended rounds")
    args = parser.parse_args()
    run(args.rounds, args.busy, lambda row: print(json.dumps(row), flush=True))


def run(rounds: int, busy: int, emit: Callable[[dict[str, Any]], None]) -> None:
    """Every figure, ``rounds`` rounds interleaved (the heavier ones every fifth round), for
    three pairs of daemons: same host with direct reads (the default), same host over UCX's
    shared memory (direct reads off), and UCX over TCP."""
    with Cluster() as cluster:
        pairs = {
            "direct": Bench(cluster, "lean", env={"KVXFERD_SAME_HOST_DIRECT_READ": "true"}),
            "ucx-shm": Bench(cluster, "lean-shm", env={"KVXFERD_SAME_HOST_DIRECT_READ": "false"}),
            "tcp": Bench(cluster, "lean-tcp", env={"UCX_TLS": "tcp,self", "KVXFERD_SAME_HOST_DIRECT_READ": "false"}),
        }
        first = pairs["direct"]
        local, echo2, echo_pairs, early = [], [], [], []
        figs: dict[str, dict[str, list[float]]] = {name: {} for name in pairs}
        for r in range(rounds + 2):
            warm, heavy = r >= 2, r >= 2 and r % 5 == 2
            e = first.small_local("echo", count=4)["seconds"]
            h_local = first.handoff(first.small_p, first.small_local, 1, 4096)
            h_early = first.handoff(first.small_p, first.small_remote, 1, 4096, early=True)
            if warm:
                echo2 += [e[0] + e[1], e[2] + e[3]]
                local.append(h_local["offer_s"] + h_local["pull_s"])
                early.append(h_early["offer_s"] + h_early["pull_s"])
            if heavy:
                echo_pairs.append(64 / first.small_local("echo", count=128, in_flight=64)["wall_s"])
                figs["direct"].setdefault("inflight_local", []).append(first.in_flight(first.small_local))
            for name, bench in pairs.items():
                if name != "tcp" or heavy:
                    _round(bench, figs[name], warm, heavy and name != "tcp", heavy, busy)
        emit(
            {
                "figure": "fixed",
                "echo2_p50_ms": p50(echo2),
                "local_4k_p50_ms": p50(local),
                "local_vs_echo2": statistics.median(local) / statistics.median(echo2),
                **{f"remote_4k_{n}_p50_ms": p50(figs[n]["remote"]) for n in ("direct", "ucx-shm")},
                **{
                    f"remote_{n}_vs_echo2": statistics.median(figs[n]["remote"]) / statistics.median(echo2)
                    for n in ("direct", "ucx-shm")
                },
                # Not a target: the ticket handed out before the offer's answer, as vLLM's
                # connector does (the offer is off the path; the pull may wait for it).
                "remote_4k_direct_early_ticket_p50_ms": p50(early),
                "remote_direct_early_ticket_vs_echo2": statistics.median(early) / statistics.median(echo2),
            }
        )
        for name in ("direct", "ucx-shm"):
            for row in _pair_rows(name, figs[name]):
                emit(row)
        inflight = {
            "figure": "inflight",
            "echo_pairs_per_s": statistics.median(echo_pairs),
            "local_per_s": statistics.median(figs["direct"]["inflight_local"]),
            **{f"remote_{n}_per_s": statistics.median(figs[n]["inflight"]) for n in ("direct", "ucx-shm")},
        }
        emit(inflight)
        emit(_targets(figs, statistics.median(local), statistics.median(echo2), inflight))
        time.sleep(1.0)
        daemons = [d for bench in pairs.values() for d in (bench.a, bench.b)]
        cpu0, t0 = sum(cpu_seconds(d) for d in daemons), time.monotonic()
        time.sleep(5.0)
        idle_pct = 100 * (sum(cpu_seconds(d) for d in daemons) - cpu0) / (time.monotonic() - t0)
        emit({"figure": "idle", "daemons": len(daemons), "cpu_pct": idle_pct})
        for name, bench in pairs.items():
            f = figs[name]
            emit(
                {
                    "figure": "contended",
                    "pair": name,
                    "busy": busy,
                    "quiet_gbps": statistics.median(f["quiet"]),
                    "contended_gbps": statistics.median(f["contended"]),
                    "ratio": statistics.median(f["contended"]) / statistics.median(f["quiet"]),
                    "cpu_s_per_gb_quiet": statistics.median(f["cpu_quiet"]),
                    "cpu_s_per_gb_contended": statistics.median(f["cpu_contended"]),
                    "transport": bench.transport,
                }
            )


def _pair_rows(name: str, f: dict[str, list[float]]) -> list[dict[str, Any]]:
    """A same-host pair's ``size``, ``offers`` and ``cpu`` rows."""
    ratio = statistics.median(f["mid"]) / statistics.median(f["big"])
    bound = _size_bound(statistics.median(f["remote"]), statistics.median(f["big"]))
    return [
        {
            "figure": "size",
            "pair": name,
            "remote_16mib_gbps": statistics.median(f["mid"]) / 1e9,
            "remote_256mib_gbps": statistics.median(f["big"]) / 1e9,
            "ratio": ratio,
            "bound": bound,
            "of_bound": ratio / bound,
        },
        {
            "figure": "offers",
            "pair": name,
            "idle_p50_ms": p50(f["idle_offer"]),
            "with_64_pulls_p50_ms": p50(f["loaded_offer"]),
            "ratio": statistics.median(f["loaded_offer"]) / statistics.median(f["idle_offer"]),
            "samples": len(f["loaded_offer"]),
        },
        {
            "figure": "cpu",
            "pair": name,
            "sender_cpu_s_per_gb": statistics.median(f["cpu_sender"]),
            "receiver_cpu_s_per_gb": statistics.median(f["cpu_receiver"]),
        },
    ]


def _targets(
    figs: dict[str, dict[str, list[float]]], local: float, echo2: float, inflight: dict[str, Any]
) -> dict[str, Any]:
    """Issue 38's targets, each with this run's figure and whether it is met."""
    row: dict[str, Any] = {"figure": "targets"}

    def target(name: str, value: float, bound: float, at_most: bool) -> None:
        row[name] = {"value": round(value, 3), "target": bound, "met": value <= bound if at_most else value >= bound}

    target("local_4k_vs_echo2", local / echo2, 1.2, True)
    for n in ("direct", "ucx-shm"):
        f = figs[n]
        target(f"remote_4k_{n}_vs_echo2", statistics.median(f["remote"]) / echo2, 1.5, True)
        target(f"remote_16mib_{n}_of_256mib", statistics.median(f["mid"]) / statistics.median(f["big"]), 0.5, False)
        target(f"remote_{n}_in_flight_per_s", inflight[f"remote_{n}_per_s"], 1000, False)
    target("local_in_flight_per_s", inflight["local_per_s"], 2000, False)
    return row


def _size_bound(fixed_s: float, big_bps: float) -> float:
    """The 16/256 MiB ratio a 16 MiB handoff would reach if it cost exactly the same run's
    4 KiB handoff (its fixed cost) plus its bytes at the 256 MiB handoff's rate beyond that
    fixed cost: what no faster data plane can beat, only a smaller fixed cost.

    >>> round(_size_bound(2e-3, 256 * MIB / 34e-3), 3)  # 2 ms fixed, 32 ms for 256 MiB of bytes
    0.531
    """
    per_byte = (256 * MIB / big_bps - fixed_s) / (256 * MIB)
    return (16 * MIB / (fixed_s + 16 * MIB * per_byte)) / big_bps


def _round(bench: Bench, f: dict[str, list[float]], warm: bool, loaded: bool, contend: bool, busy: int) -> None:
    """One round of a pair's measurements into ``f`` (kept once ``warm``)."""
    h_remote = bench.handoff(bench.small_p, bench.small_remote, 1, 4096)
    h_mid = bench.handoff(bench.big_p, bench.big_remote, 8, 256)  # 16 MiB
    a0, b0 = cpu_seconds(bench.a), cpu_seconds(bench.b)
    h_big = bench.handoff(bench.big_p, bench.big_remote, 128, 256)  # 256 MiB
    a1, b1 = cpu_seconds(bench.a), cpu_seconds(bench.b)
    idle = [bench.small_p("offer", requests=[[int(bench.rng.integers(4096))]])["offer_s"] for _ in range(3)]
    if not warm:
        return
    gb = 256 * MIB / 1e9
    for key, value in (
        ("remote", h_remote["offer_s"] + h_remote["pull_s"]),
        ("mid", 16 * MIB / (h_mid["offer_s"] + h_mid["pull_s"])),
        ("big", 256 * MIB / (h_big["offer_s"] + h_big["pull_s"])),
        ("cpu_sender", (a1 - a0) / gb),
        ("cpu_receiver", (b1 - b0) / gb),
    ):
        f.setdefault(key, []).append(value)
    f.setdefault("idle_offer", []).extend(idle)
    if loaded:
        f.setdefault("loaded_offer", []).extend(bench.offers_under_load(64))
        f.setdefault("inflight", []).append(bench.in_flight(bench.small_remote))
    if contend:
        q, c, cq, cc = _contended(bench, (bench.a, bench.b), busy)
        for key, value in (("quiet", q), ("contended", c), ("cpu_quiet", cq), ("cpu_contended", cc)):
            f.setdefault(key, []).append(value)


def _contended(bench: Bench, daemons: tuple[Daemon, ...], busy: int) -> tuple[float, float, float, float]:
    """256 MiB remote GB/s and daemons' CPU s/GB, quiet then with ``busy`` busy processes."""

    def one() -> tuple[float, float]:
        c0 = sum(cpu_seconds(d) for d in daemons)
        h = bench.handoff(bench.big_p, bench.big_remote, 128, 256)
        gb = 256 * MIB / 1e9
        return gb / (h["offer_s"] + h["pull_s"]), (sum(cpu_seconds(d) for d in daemons) - c0) / gb

    q, cq = one()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.2)
        c, cc = one()
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    return q, c, cq, cc


if __name__ == "__main__":
    main()
