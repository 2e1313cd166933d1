"""What a handoff costs beyond its bytes: fixed cost, offers under load, CPU per GB, contention.

Two daemons on this host (host pools), engines in their own processes, everything measured
round by round in one run so that the machine's drift hits every figure alike:

* ``fixed``: a 4 KiB handoff (offer in the prefill engine + pull in the decode engine), local
  and remote, against two gRPC unary echoes (health checks on the daemon's engine socket);
* ``size``: remote GB/s of a 16 MiB request (about 128 tokens of Llama-3-8B KV) against a
  256 MiB one;
* ``offers``: an offer's latency idle, and with 64 remote pulls of 4 MiB in flight on the
  offering daemon;
* ``cpu``: both daemons' CPU seconds per GB moved (256 MiB remote handoffs), and their CPU
  use while idle with live peers;
* ``contended``: 256 MiB remote GB/s quiet and with ``--busy`` busy-looping processes beside
  the daemons, over the same-host transport UCX picks between two daemons here and over TCP
  (a second pair of daemons with ``UCX_TLS=tcp,self``, as two hosts without RDMA use).

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

    def handoff(self, prefill: EngineProcess, decode: EngineProcess, blocks: int, pool_blocks: int) -> dict[str, float]:
        """One offer and its pull: the engines' own times (offer_s, pull_s) and the daemon's."""
        src = self.rng.permutation(pool_blocks)[:blocks].tolist()
        dst = self.rng.permutation(pool_blocks)[:blocks].tolist()
        offered = prefill("offer", requests=[src])
        [res] = decode("pull", pulls=[[offered["tickets"][0], dst]])["results"]
        if not res["ok"]:
            raise RuntimeError(f"pull failed: {res}")
        self.transport = res["transport"]
        return {"offer_s": offered["offer_s"], "pull_s": res["latency_s"], "daemon_s": res["daemon_s"]}

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
    """Every figure, ``rounds`` rounds interleaved (the heavier ones every fifth round)."""
    with Cluster() as cluster:
        bench = Bench(cluster)
        tcp = Bench(cluster, "lean-tcp", env={"UCX_TLS": "tcp,self"})
        tcp_quiet, tcp_contended = [], []
        local, remote, echo2, mid, big = [], [], [], [], []
        idle_offer, loaded_offer = [], []
        cpu_big, quiet, contended, cpu_quiet, cpu_contended = [], [], [], [], []
        daemons = (bench.a, bench.b)
        for r in range(rounds + 2):
            warm = r >= 2
            e = bench.small_local("echo", count=4)["seconds"]
            h_local = bench.handoff(bench.small_p, bench.small_local, 1, 4096)
            h_remote = bench.handoff(bench.small_p, bench.small_remote, 1, 4096)
            h_mid = bench.handoff(bench.big_p, bench.big_remote, 8, 256)  # 16 MiB
            cpu0 = sum(cpu_seconds(d) for d in daemons)
            h_big = bench.handoff(bench.big_p, bench.big_remote, 128, 256)  # 256 MiB
            cpu1 = sum(cpu_seconds(d) for d in daemons)
            idle = [bench.small_p("offer", requests=[[int(bench.rng.integers(4096))]])["offer_s"] for _ in range(3)]
            if warm:
                echo2 += [e[0] + e[1], e[2] + e[3]]
                local.append(h_local["offer_s"] + h_local["pull_s"])
                remote.append(h_remote["offer_s"] + h_remote["pull_s"])
                mid.append(16 * MIB / (h_mid["offer_s"] + h_mid["pull_s"]))
                big.append(256 * MIB / (h_big["offer_s"] + h_big["pull_s"]))
                cpu_big.append((cpu1 - cpu0) / (256 * MIB / 1e9))
                idle_offer += idle
            if warm and r % 5 == 2:  # the heavier rounds, every fifth
                loaded_offer += bench.offers_under_load(64)
                q, c, cq, cc = _contended(bench, daemons, busy)
                quiet.append(q)
                contended.append(c)
                cpu_quiet.append(cq)
                cpu_contended.append(cc)
                q, c, _, _ = _contended(tcp, (tcp.a, tcp.b), busy)
                tcp_quiet.append(q)
                tcp_contended.append(c)
        emit(
            {
                "figure": "fixed",
                "echo2_p50_ms": p50(echo2),
                "local_4k_p50_ms": p50(local),
                "remote_4k_p50_ms": p50(remote),
                "local_vs_echo2": statistics.median(local) / statistics.median(echo2),
                "remote_vs_echo2": statistics.median(remote) / statistics.median(echo2),
            }
        )
        emit(
            {
                "figure": "size",
                "remote_16mib_gbps": statistics.median(mid) / 1e9,
                "remote_256mib_gbps": statistics.median(big) / 1e9,
                "ratio": statistics.median(mid) / statistics.median(big),
            }
        )
        emit(
            {
                "figure": "offers",
                "idle_p50_ms": p50(idle_offer),
                "with_64_pulls_p50_ms": p50(loaded_offer),
                "ratio": statistics.median(loaded_offer) / statistics.median(idle_offer),
                "samples": len(loaded_offer),
            }
        )
        time.sleep(1.0)
        cpu0, t0 = sum(cpu_seconds(d) for d in daemons), time.monotonic()
        time.sleep(5.0)
        idle_pct = 100 * (sum(cpu_seconds(d) for d in daemons) - cpu0) / (time.monotonic() - t0)
        emit({"figure": "cpu", "daemons_cpu_s_per_gb": statistics.median(cpu_big), "idle_cpu_pct": idle_pct})
        emit(
            {
                "figure": "contended",
                "busy": busy,
                "quiet_gbps": statistics.median(quiet),
                "contended_gbps": statistics.median(contended),
                "ratio": statistics.median(contended) / statistics.median(quiet),
                "cpu_s_per_gb_quiet": statistics.median(cpu_quiet),
                "cpu_s_per_gb_contended": statistics.median(cpu_contended),
                "transport": bench.transport,
            }
        )
        emit(
            {
                "figure": "contended",
                "busy": busy,
                "quiet_gbps": statistics.median(tcp_quiet),
                "contended_gbps": statistics.median(tcp_contended),
                "ratio": statistics.median(tcp_contended) / statistics.median(tcp_quiet),
                "transport": tcp.transport,
            }
        )


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
