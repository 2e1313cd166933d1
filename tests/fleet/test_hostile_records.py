"""Registry records as hostile input (anyone who may write to etcd may write them): a daemon
puts its own record back the moment another writer overwrites it; a record under another
daemon's key, one on no lease, and ones too large are ignored by every reader (a daemon's
listing and watch, ``kvxferctl fleet``) and never make a listing too big to receive; what a
record says reaches the operator's terminal escaped."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from bench.cluster import ROOT, Cluster, Daemon, wait_for
from bench.etcd import EtcdCluster, handoff, registry_args
from kvxfer.fleet import RegistryUrl, etcd_client
from kvxfer.proto import admin_pb2
from kvxfer.version import PROTOCOL_VERSION


def _nodes(daemon: Daemon) -> int:
    return int(daemon.admin("Status", admin_pb2.StatusRequest()).registry_nodes)


def _record(daemon_id: str, address: str, **more: str) -> str:
    record = {
        "v": 1,
        "daemon_id": daemon_id,
        "peer_address": address,
        "admin_address": "",
        "version": "0",
        "protocol_version": PROTOCOL_VERSION,
        "hostname": "writer",
        "started_at": time.time(),
        **more,
    }
    return json.dumps(record)


def _lease(etcd: EtcdCluster) -> str:
    return etcd.ctl("lease", "grant", "120").split()[1]


def _fleet(etcd: EtcdCluster, cluster: str, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvxfer_client._ctl", "--timeout", "2", *flags, "fleet"]
    cmd += ["--registry", etcd.url, "--cluster", cluster]
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)


def test_an_overwritten_record_is_put_back_at_once(etcd: EtcdCluster) -> None:
    """Overwritten to point elsewhere (on a lease of the writer's, then on none), the live
    daemon's record is its own again within moments, and the fleet shows its real address."""
    key = "/kvxfer/over/daemons/real"
    with Cluster() as cluster:
        real = cluster.daemon("real", *registry_args(etcd, "over"))
        other = cluster.daemon("other", *registry_args(etcd, "over"))
        wait_for(lambda: _nodes(other) == 2, "both daemons registered")
        restored_s = []
        for lease in (_lease(etcd), ""):
            started = time.monotonic()
            put = ("put", f"--lease={lease}") if lease else ("put",)
            etcd.ctl(*put, key, _record("real", "127.0.0.1:9"))
            wait_for(
                lambda: (
                    json.loads(etcd.ctl("get", key, "--print-value-only"))["peer_address"] == real.info["peer_address"]
                ),
                "the overwritten record put back",
                10,
            )
            restored_s.append(round(time.monotonic() - started, 2))
        print(f"\noverwritten record restored after (s): {restored_s}")
        assert real.log().count("registry.record_overwritten") == 2
        rows = json.loads(_fleet(etcd, "over", "--json").stdout)["daemons"]
        assert [(r["daemon"], r["state"], r["address"]) for r in rows] == [
            ("other", "serving", other.info["peer_address"]),
            ("real", "serving", real.info["peer_address"]),
        ]


async def _put_large(url: str, keys: list[str], size: int) -> None:
    client = etcd_client(RegistryUrl.parse(url))
    await client.connect()
    try:
        assert client.kv is not None and client.lease is not None
        lease = (await client.lease.grant(120)).ID
        for key in keys:
            await client.kv.put(
                key.encode(), _record(key.rsplit("/", 1)[1], "127.0.0.1:9", pad="x" * size), lease=lease
            )
    finally:
        await client.close()


def test_decoy_leaseless_and_oversized_records_leave_every_view_correct(etcd: EtcdCluster) -> None:
    """A decoy key claiming a live daemon's id, a record on no lease, and four of 1.4 MiB: a
    daemon that starts among them lists the two real ones, counts them right, and hands off;
    ``kvxferctl fleet`` shows the daemons serving and the rest ignored, escaped."""
    prefix = "/kvxfer/decoy/daemons/"
    with Cluster() as cluster:
        a = cluster.daemon("a", *registry_args(etcd, "decoy"))
        etcd.ctl("put", f"--lease={_lease(etcd)}", prefix + "zz-decoy", _record("a", "127.0.0.1:9"))
        etcd.ctl("put", prefix + "ghost", _record("ghost", "127.0.0.1:9"))
        asyncio.run(_put_large(etcd.url, [f"{prefix}big{i}" for i in range(4)], 1400 << 10))
        b = cluster.daemon("b", *registry_args(etcd, "decoy"))  # lists all of it at its start
        wait_for(lambda: _nodes(b) == 2 and _nodes(a) == 2, "each daemon to count the two real ones")
        assert b.admin("Status", admin_pb2.StatusRequest()).registry_state == "registered"
        assert "registry.record_ignored key=zz-decoy" in b.log()
        assert handoff(cluster, a, b, "decoy")["verified"]

        fleet = _fleet(etcd, "decoy", "--json")
        assert fleet.returncode == 0, fleet.stdout + fleet.stderr
        states = {r["daemon"]: r["state"] for r in json.loads(fleet.stdout)["daemons"]}
        assert states == {"a": "serving", "b": "serving", "ghost": "ignored", "zz-decoy": "ignored"} | {
            f"big{i}": "ignored" for i in range(4)
        }

        # A record a reader may use, whose words are a terminal's escape sequences.
        etcd.ctl("put", f"--lease={_lease(etcd)}", prefix + "esc", _record("esc", "127.0.0.1:9", version="\x1b[2J"))
        table = _fleet(etcd, "decoy")
        assert "\x1b" not in table.stdout and "\\x1b[2J" in table.stdout, table.stdout
