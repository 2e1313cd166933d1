"""Daemons in a real etcd: they register, see each other, leave on drain or when killed, refuse
a second claim on one id, and are found by id after a restart on a new port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bench.cluster import ROOT, Cluster, wait_for
from bench.etcd import SHAPE, TTL_S, EtcdCluster, handoff, registry_args
from kvxfer.proto import admin_pb2
from kvxfer_client import AsyncKvxferClient, HostBuffer, Layout


def _status(daemon):  # type: ignore[no-untyped-def]
    return daemon.admin("Status", admin_pb2.StatusRequest())


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "kvxfer_client._ctl", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)


def test_four_daemons_register_see_each_other_and_leave_on_drain_or_death(etcd: EtcdCluster) -> None:
    with Cluster() as cluster:
        daemons = [cluster.daemon(f"n{i}", *registry_args(etcd, "four")) for i in range(4)]
        assert sorted(etcd.keys("/kvxfer/four/")) == [f"/kvxfer/four/daemons/n{i}" for i in range(4)]
        record = json.loads(etcd.ctl("get", "/kvxfer/four/daemons/n2", "--print-value-only"))
        assert record["peer_address"] == daemons[2].info["peer_address"]
        assert record["admin_address"] == daemons[2].info["admin_address"]
        assert record["pid"] == daemons[2].proc.pid and record["protocol_version"] > 0
        for d in daemons:
            wait_for(lambda d=d: _status(d).registry_nodes == 4, f"{d.name} to list all four")
            assert _status(d).registry_state == "registered"
        # A handoff between two registered daemons goes as before.
        assert handoff(cluster, daemons[0], daemons[1], "reg")["verified"]

        fleet = _ctl("--json", "fleet", "--registry", etcd.url, "--cluster", "four")
        assert fleet.returncode == 0, fleet.stdout + fleet.stderr
        rows = json.loads(fleet.stdout)["daemons"]
        assert [(r["daemon"], r["state"], r["registry"]) for r in rows] == [
            (f"n{i}", "serving", "registered") for i in range(4)
        ]

        # Drained: the record goes as the daemon exits, not a lease later.
        assert daemons[3].terminate() == 0
        assert "/kvxfer/four/daemons/n3" not in etcd.keys("/kvxfer/four/")
        wait_for(lambda: _status(daemons[0]).registry_nodes == 3, "n0 to see n3 leave", timeout_s=5)

        # Killed: the record goes with its lease, and no pull dials it any more.
        prefill, decode = cluster.engine(daemons[2], "p-dead"), cluster.engine(daemons[1], "d-dead")
        prefill("pool", shape=SHAPE, seed=1)
        decode("pool", shape=SHAPE)
        ticket = prefill("offer", requests=[[0, 1]], lease_s=60)["tickets"][0]
        daemons[2].kill()
        killed = time.monotonic()
        wait_for(lambda: "/kvxfer/four/daemons/n2" not in etcd.keys("/kvxfer/four/"), "n2's record to lapse", 30)
        gone_s = time.monotonic() - killed
        assert gone_s < TTL_S + 2, gone_s
        wait_for(lambda: "registry.peer_left peer=n2" in daemons[0].log(), "n0 to log n2's leaving", 5)
        wait_for(lambda: "registry.peer_left peer=n2" in daemons[1].log(), "n1 to log n2's leaving", 5)
        started = time.monotonic()
        result = decode("pull", pulls=[[ticket, [0, 1]]], timeout_s=20)["results"][0]
        assert not result["ok"] and result["type"] == "UnavailableError", result
        assert "left the fleet registry" in result["error"] and time.monotonic() - started < 1.0
        print(f"\nSIGKILLed daemon's record gone after {gone_s:.2f}s (ttl {TTL_S}s)")


def test_a_second_daemon_claiming_a_live_id_is_refused(etcd: EtcdCluster) -> None:
    with Cluster() as cluster:
        first = cluster.daemon("twin", *registry_args(etcd, "ids"))
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="already registered in cluster 'ids'") as refused:
            cluster.daemon("twin", *registry_args(etcd, "ids"), "--engine-socket", first.socket + "2")
        waited = time.monotonic() - started
        assert "give this daemon another daemon_id" in str(refused.value)
        # It waited one lease for a dead holder's record to lapse, and no longer.
        assert TTL_S < waited < TTL_S + 10, waited
        assert _status(first).registry_state == "registered"
        held = json.loads(etcd.ctl("get", "/kvxfer/ids/daemons/twin", "--print-value-only"))
        assert held["pid"] == first.proc.pid


def test_a_crashed_daemons_record_is_taken_over_by_its_restart_at_once(etcd: EtcdCluster) -> None:
    with Cluster() as cluster:
        d = cluster.daemon("phoenix", *registry_args(etcd, "restart", ttl_s=30))
        old_pid = d.proc.pid
        d.kill()  # its record would live 30 s more
        started = time.monotonic()
        d.start()
        assert time.monotonic() - started < 10
        held = json.loads(etcd.ctl("get", "/kvxfer/restart/daemons/phoenix", "--print-value-only"))
        assert held["pid"] == d.proc.pid != old_pid
        assert "took over the record" in d.log()


LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=16, block_bytes=4096)


async def _pool(client: AsyncKvxferClient, seed: int | None = None):  # type: ignore[no-untyped-def]
    buffers = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    for i, b in enumerate(buffers):
        b.array()[:] = np.random.default_rng((seed or 0) + i).integers(0, 256, b.size, dtype=np.uint8)
    return await client.register_pool(buffers, LAYOUT), buffers


async def test_a_daemon_restarted_on_a_new_port_is_reached_by_id_with_an_old_ticket(etcd: EtcdCluster) -> None:
    """The router holds a ticket made before the prefill daemon restarted; the prefill engine
    makes the offer under it on the restarted daemon, now on another port. The decode daemon
    does not find it at the ticket's address and finds it by id in the registry."""
    with Cluster() as cluster:
        a = cluster.daemon("pre", *registry_args(etcd, "moved"))
        b = cluster.daemon("dec", *registry_args(etcd, "moved"))
        async with AsyncKvxferClient(b.socket, engine_name="d") as decode:
            dst, dst_buf = await _pool(decode)
            async with AsyncKvxferClient(a.socket, engine_name="p") as prefill:
                src, _ = await _pool(prefill, seed=3)
                warm = await prefill.offer(src, [0])
                await decode.pull(warm, dst, [0])  # the decode daemon knows "pre" at its old address
                ticket = prefill.new_ticket(src, 3)
            old_address = a.info["peer_address"]
            a.kill()
            a.start()
            assert a.info["peer_address"] != old_address
            wait_for(lambda: b"pre" in etcd.ctl("get", "/kvxfer/moved/daemons/pre").encode(), "pre's new record")
            wait_for(lambda: a.info["peer_address"] in etcd.ctl("get", "/kvxfer/moved/daemons/pre"), "new address")
            async with AsyncKvxferClient(a.socket, engine_name="p2") as prefill:
                src, src_buf = await _pool(prefill, seed=3)
                await prefill.offer(src, [4, 1, 12], ticket=ticket)
                assert ticket.peer_address == old_address
                result = await decode.pull(ticket, dst, [7, 8, 9], timeout_s=20)
                assert result.bytes == 3 * LAYOUT.bytes_per_block
                for s, d in zip([4, 1, 12], [7, 8, 9], strict=True):
                    for r in LAYOUT.regions:
                        got = dst_buf[r.buffer_index].array()[r.offset + d * r.block_stride :][: r.block_bytes]
                        want = src_buf[r.buffer_index].array()[r.offset + s * r.block_stride :][: r.block_bytes]
                        assert (got == want).all()
        assert f"peer.found_in_registry peer=pre ticket_address={old_address}" in b.log()


def test_the_fleet_view_shows_a_registered_daemon_that_does_not_answer(etcd: EtcdCluster) -> None:
    with Cluster() as cluster:
        up = cluster.daemon("up", *registry_args(etcd, "view", ttl_s=30))
        frozen = cluster.daemon("frozen", *registry_args(etcd, "view", ttl_s=30))
        assert frozen.proc is not None
        frozen.proc.send_signal(signal.SIGSTOP)
        try:
            table = _ctl("--timeout", "1", "fleet", "--registry", etcd.url, "--cluster", "view")
            as_json = _ctl("--timeout", "1", "--json", "fleet", "--registry", etcd.url, "--cluster", "view")
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
        assert table.returncode == 1, table.stdout + table.stderr
        assert "2 registered, 1 serving" in table.stdout
        assert any(line.split()[:1] == ["frozen"] and "unreachable" in line for line in table.stdout.splitlines())
        states = {r["daemon"]: r["state"] for r in json.loads(as_json.stdout)["daemons"]}
        assert states == {"up": "serving", "frozen": "unreachable"}
        status = _ctl("--socket", up.socket, "status")
        assert "registry    registered in etcd://" in status.stdout, status.stdout


def test_the_registry_is_not_reachable_at_all_and_the_daemon_starts_anyway() -> None:
    with Cluster() as cluster:
        d = cluster.daemon("lonely", "--registry", "etcd://127.0.0.1:9", "--registry-ttl-s", "3")
        status = _status(d)
        assert status.registry_state == "unreachable", status
        assert d.metric("kvxfer_registry_state") == 1
        assert "registry.state state=unreachable" in d.log()


def _lease_of(etcd: EtcdCluster, key: str) -> str:
    """The lease a key is attached to, as etcdctl writes it (hex)."""
    kvs = json.loads(etcd.ctl("get", key, "-w", "json")).get("kvs", [])
    return format(int(kvs[0]["lease"]), "x") if kvs else ""


def test_a_lost_lease_and_a_deleted_record_are_put_back_without_a_restart(etcd: EtcdCluster) -> None:
    key = "/kvxfer/lost/daemons/keeper"
    with Cluster() as cluster:
        d = cluster.daemon("keeper", *registry_args(etcd, "lost"))
        pid, lease = d.proc.pid, _lease_of(etcd, key)
        etcd.ctl("lease", "revoke", lease)  # what etcd does to a lease it stopped hearing about
        wait_for(lambda: _lease_of(etcd, key) not in ("", lease), "the record on a new lease", 3 * TTL_S)
        assert "registry.lease_lost" in d.log()
        etcd.ctl("del", key)  # someone deleted our record
        wait_for(lambda: _lease_of(etcd, key) != "", "the record put back", 3 * TTL_S)
        assert d.proc.pid == pid and d.proc.poll() is None
        assert _status(d).registry_state == "registered"


def test_a_watch_compacted_past_lists_again_and_sees_who_left(etcd: EtcdCluster) -> None:
    """Between the listing and the watch (a fault point holds it there), a record leaves and
    etcd compacts its history: the watch cannot start where it should, lists again, and finds
    the daemon gone."""
    ghost = "/kvxfer/compact/daemons/ghost"
    record = {"v": 1, "daemon_id": "ghost", "peer_address": "10.9.9.9:7461", "admin_address": ""}
    record |= {"version": "0", "protocol_version": 3, "hostname": "h", "started_at": 0.0}
    lease = etcd.ctl("lease", "grant", "120").split()[1]  # a daemon's record is on a lease
    etcd.ctl("put", f"--lease={lease}", ghost, json.dumps(record))
    with Cluster() as cluster:
        d = cluster.daemon(
            "watcher", *registry_args(etcd, "compact"), "--fault-injection", "--faults", "registry_watch=pause:4"
        )
        wait_for(lambda: "fault.hit point=registry_watch" in d.log(), "the watch to be held")
        etcd.ctl("del", ghost)
        etcd.ctl("put", "/kvxfer-test/filler", "x")  # compacted past the deletion, not to it
        revision = json.loads(etcd.ctl("get", "/", "-w", "json"))["header"]["revision"]
        etcd.ctl("compaction", str(revision))
        assert "registry.relist" not in d.log()  # all of that while the watch was held
        assert _status(d).registry_nodes == 2  # it listed the ghost, and has heard nothing since
        wait_for(lambda: "registry.peer_left peer=ghost" in d.log(), "the ghost noticed gone", 15)
        assert "registry.relist" in d.log() and "listed again" in d.log()
        assert _status(d).registry_nodes == 1
