"""A dead engine's memory leaves the daemon: after each kill mid-pull, the daemon's mappings
of that engine's shared memory and its resident size come back to where they were.

Found by an independent fault run: the finished transfer's task, kept in the history, held
the failed handler's frames and with them the pool's views (516 MiB, then 1,028 MiB mapped
with no pool registered). Windows are hit through the offering daemon's fault points."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import grpc

from bench.cluster import Cluster, Daemon
from kvxfer_client._proto import admin_pb2, admin_pb2_grpc

SHAPE = {"layers": 32, "blocks": 32, "block_bytes": 32 << 10}  # 64 MiB per pool
BOUND_S = 10.0


def _shm_mappings(daemon: Daemon) -> int:
    assert daemon.proc is not None
    with open(f"/proc/{daemon.proc.pid}/maps") as fh:
        return len(set(re.findall(r"/dev/shm/(kvxfer-\S+)", fh.read())))


def _rss_mib(daemon: Daemon) -> float:
    assert daemon.proc is not None
    with open(f"/proc/{daemon.proc.pid}/status") as fh:
        match = re.search(r"VmRSS:\s+(\d+)", fh.read())
    assert match is not None
    return int(match.group(1)) / 1024


def _unconfirmed(daemon: Daemon) -> int:
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        status = admin_pb2_grpc.AdminServiceStub(channel).Status(admin_pb2.StatusRequest(), timeout=10)
    return int(status.ucx_receives_unconfirmed)


def _wait_until(condition: Callable[[], bool], what: str, logs: Callable[[], str] = str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < BOUND_S, f"{what} not within {BOUND_S}s\n{logs()}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_each_decode_engine_killed_mid_pull_leaves_no_mapping_behind(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--fault-injection", "--faults", "after_accepted=pause:2")
    b = cluster.daemon("b")
    prefill = cluster.engine(a, "p")
    prefill("pool", shape=SHAPE, seed=1)
    baseline_rss = _rss_mib(b)
    for round_ in range(3):
        decode = cluster.engine(b, f"d{round_}")
        decode("pool", shape=SHAPE)
        assert _shm_mappings(b) == SHAPE["layers"]
        ticket = prefill("offer", requests=[list(range(32))], lease_s=600)["tickets"][0]
        hits = a.log().count("point=after_accepted")
        assert decode.proc.stdin is not None
        decode.proc.stdin.write((json.dumps({"op": "pull", "pulls": [[ticket, list(range(32))]]}) + "\n").encode())
        decode.proc.stdin.flush()
        _wait_until(
            lambda h=hits: a.log().count("point=after_accepted") > h,
            "the offerer's pause",
            lambda: a.log()[-3000:] + b.log()[-3000:],
        )
        decode.kill()  # receives are posted into its pool now
        took = _wait_until(lambda: _shm_mappings(b) == 0, "the dead engine's memory unmapped")
        print(f"round {round_}: unmapped {took:.2f}s after the kill, rss {_rss_mib(b):.0f} MiB")
        assert _unconfirmed(b) == 0
    assert _rss_mib(b) < baseline_rss + 32, (baseline_rss, _rss_mib(b))
