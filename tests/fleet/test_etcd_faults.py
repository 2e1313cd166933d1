"""etcd itself failing under a running fleet: its leader killed in a three-member cluster, and
etcd stopped altogether. Neither may fail a handoff, and the records are back afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

from bench.cluster import ROOT, Cluster, Daemon, wait_for
from bench.etcd import TTL_S, EtcdCluster, handoff, registry_args
from kvxfer.proto import admin_pb2


def _state(daemon: Daemon) -> str:
    return str(daemon.admin("Status", admin_pb2.StatusRequest()).registry_state)


class Handoffs:
    """Handoffs from ``src`` to ``dst`` one after another in a thread, until stopped."""

    def __init__(self, cluster: Cluster, src: Daemon, dst: Daemon) -> None:
        self.results: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._args = (cluster, src, dst)
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.results.append(handoff(*self._args, f"bg{len(self.results)}", timeout_s=20))

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(120)
        return self.results


def test_the_etcd_leader_killed_mid_run_fails_no_handoff_and_loses_no_record() -> None:
    with EtcdCluster(3) as etcd, Cluster() as cluster:
        a = cluster.daemon("a", *registry_args(etcd, "ha"))
        b = cluster.daemon("b", *registry_args(etcd, "ha"))
        running = Handoffs(cluster, a, b)
        try:
            wait_for(lambda: len(running.results) >= 2, "handoffs before the kill", 60)
            leader = etcd.leader()
            etcd.kill(leader)
            killed_at = time.monotonic()
            # Two leases pass with the old leader gone: the keep-alives went to the others.
            while time.monotonic() - killed_at < 2 * TTL_S:
                time.sleep(0.2)
                assert sorted(etcd.keys("/kvxfer/ha/")) == ["/kvxfer/ha/daemons/a", "/kvxfer/ha/daemons/b"]
            new_leader = etcd.leader()
        finally:
            results = running.stop()
        assert new_leader != leader
        assert len(results) >= 4 and all(r["ok"] and r["verified"] for r in results), results
        assert _state(a) == _state(b) == "registered"
        for d in (a, b):  # nobody was taken for gone
            assert "registry.peer_left" not in d.log()
        # Its member back, the cluster is whole again and the records are where they were.
        etcd.start(leader)
        etcd.wait_healthy()
        assert len(etcd.keys("/kvxfer/ha/")) == 2
        print(f"\n{len(results)} handoffs, none failed, across the etcd leader's death ({leader} -> {new_leader})")


def test_etcd_stopped_for_a_while_stops_no_handoff_and_the_records_come_back() -> None:
    with EtcdCluster(1) as etcd, Cluster() as cluster:
        a = cluster.daemon("a", *registry_args(etcd, "down"))
        b = cluster.daemon("b", *registry_args(etcd, "down"))
        assert handoff(cluster, a, b, "before")["verified"]
        etcd.stop_all()
        stopped = time.monotonic()
        for d in (a, b):
            wait_for(lambda d=d: _state(d) == "unreachable", f"{d.name} to see etcd gone", 3 * TTL_S)
            assert d.metric('kvxfer_registry_state{state="unreachable"}') == 1
        # Longer than a lease: handoffs go by the tickets' addresses meanwhile.
        results = []
        while time.monotonic() - stopped < 2 * TTL_S:
            results.append(handoff(cluster, a, b, f"down{len(results)}"))
        assert results and all(r["ok"] and r["verified"] for r in results), results
        assert a.log().count("registry.state state=unreachable") == 1  # logged once per change
        shown = subprocess.run(
            [sys.executable, "-m", "kvxfer_client._ctl", "--socket", a.socket, "status"],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=ROOT),
            timeout=60,
            check=True,
        ).stdout
        assert f"registry    unreachable in {etcd.url} (cluster down" in shown, shown
        etcd.start_all()
        for d in (a, b):
            wait_for(lambda d=d: _state(d) == "registered", f"{d.name} to register again", 5 * TTL_S)
        wait_for(lambda: len(etcd.keys("/kvxfer/down/")) == 2, "both records back", 5 * TTL_S)
        assert handoff(cluster, a, b, "after")["verified"]
        for d in (a, b):
            assert "registry.peer_left" not in d.log()
