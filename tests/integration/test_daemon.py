"""The daemon as a process: drain on SIGTERM, health, reflection, kvxferctl."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.cluster import Cluster, _env
from kvxfer_client import AsyncKvxferClient, HostBuffer, Layout, ReleaseReason, UnavailableError

BLOCK = 96 << 20
BIG = Layout.paged_kv(num_layers=1, num_blocks=2, block_bytes=BLOCK)


def ctl(daemon_socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvxfer_client._ctl", "--socket", daemon_socket, *args],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )


async def test_sigterm_drains_finishes_the_running_transfer_and_exits_0(cluster: Cluster) -> None:
    # Small chunks and a window of one make a 192 MiB pull (3072 chunks, one at a time) take
    # long enough to overlap SIGTERM.
    slow = ("--chunk-bytes", "65536", "--window", "1")
    a, b = cluster.daemon("drain-a", *slow), cluster.daemon("drain-b", *slow)
    p = await AsyncKvxferClient(a.socket, engine_name="p").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="d").connect()
    src = [HostBuffer.create(s) for s in BIG.buffer_sizes()]
    src[0].array()[:] = np.random.default_rng(0).integers(0, 256, src[0].size, dtype=np.uint8)
    dst = [HostBuffer.create(s) for s in BIG.buffer_sizes()]
    ppool, dpool = await p.register_pool(src, BIG), await d.register_pool(dst, BIG)
    ticket = await p.offer(ppool, [0])
    spare = await p.offer(ppool, [1], lease_s=600)

    pull = asyncio.create_task(d.pull(ticket, dpool, [1]))
    await asyncio.sleep(0.05)
    assert b.proc is not None
    b.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.05)
    assert not pull.done(), "the pull finished before the drain began; the test proves nothing"
    with pytest.raises(UnavailableError, match="draining"):
        await d.pull(spare, dpool, [0])

    result = await pull  # the running transfer finishes inside the grace period
    assert result.bytes == 2 * BLOCK
    k, v = src[0].array()[:BLOCK], src[0].array()[2 * BLOCK : 3 * BLOCK]
    assert np.array_equal(dst[0].array()[BLOCK : 2 * BLOCK], k)
    assert np.array_equal(dst[0].array()[3 * BLOCK :], v)
    assert await asyncio.to_thread(b.proc.wait, 30) == 0
    log = b.log()
    assert log.index("daemon.drain") < log.index("transfer.done")

    # The prefill daemon drains too: its live offer is released with reason "shutdown".
    assert a.terminate() == 0
    assert (await p.wait_released(spare.offer_id, 5)).reason is ReleaseReason.SHUTDOWN
    await p.close()
    await d.close()


def test_health_and_reflection_answer_on_every_listener(two_daemons: Cluster) -> None:
    info = two_daemons.daemons[0].info
    targets = {
        "unix:" + info["engine_socket"]: "kvxfer.v1.EngineService",
        info["peer_address"]: "kvxfer.v1.PeerService",
        info["admin_address"]: "kvxfer.v1.AdminService",
    }
    for target, service in targets.items():
        with grpc.insecure_channel(target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            names = {s.name for s in replies[0].list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


def test_kvxferctl_tells_the_truth(two_daemons: Cluster) -> None:
    a, b = two_daemons.daemons
    prefill = two_daemons.engine(a, "ctl-prefill")
    decode = two_daemons.engine(b, "ctl-decode")
    shape = {"layers": 1, "blocks": 16, "block_bytes": 4096}
    prefill("pool", shape=shape, seed=1)
    decode("pool", shape=shape)
    pulled, kept = prefill("offer", requests=[[1, 2], [3]], lease_s=300)["tickets"]
    result = decode("pull", pulls=[[pulled, [5, 6]]])["results"][0]
    assert result["ok"]

    status = json.loads(ctl(a.socket, "--json", "status").stdout)
    assert status["status"]["daemon_id"] == "a"
    assert kept["offer_id"] in {o["offer"] for o in status["offers"]}
    assert pulled["offer_id"] not in {o["offer"] for o in status["offers"]}
    assert "b" in {p["peer"] for p in status["peers"]}
    assert any(p["engine"] == "ctl-prefill" for p in status["pools"])

    transfers = json.loads(ctl(b.socket, "--json", "transfers", "--all").stdout)
    row = next(t for t in transfers if t["transfer"] == result["transfer_id"])
    assert (row["role"], row["path"], row["state"], row["transport"]) == (
        "decode",
        "remote",
        "succeeded",
        "ucx:shm+cma",
    )

    human = ctl(a.socket, "status").stdout
    assert re.search(r"daemon\s+a ", human) and kept["offer_id"] in human

    # The plaintext admin port reads but does not change anything.
    remote = subprocess.run(
        [sys.executable, "-m", "kvxfer_client._ctl", "--addr", a.info["admin_address"], "cancel", kept["offer_id"]],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    assert remote.returncode == 1 and "only on the daemon's Unix socket" in remote.stderr
    assert json.loads(
        subprocess.run(
            [sys.executable, "-m", "kvxfer_client._ctl", "--addr", a.info["admin_address"], "--json", "offers"],
            capture_output=True,
            text=True,
            env=_env(),
            check=True,
        ).stdout
    )

    cancel = ctl(a.socket, "cancel", kept["offer_id"])
    assert cancel.returncode == 0 and "released" in cancel.stdout
    assert ctl(a.socket, "cancel", "nope").returncode == 1
    assert ctl("/nonexistent/kvxferd.sock", "status").returncode == 3


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_daemons_are_quiet_when_idle_after_transfers(two_daemons: Cluster) -> None:
    """UCX progress must not spin once the transfers are over (UCXX's own driver did)."""
    a, b = two_daemons.daemons
    prefill = two_daemons.engine(a, "idle-prefill")
    decode = two_daemons.engine(b, "idle-decode")
    shape = {"layers": 2, "blocks": 64, "block_bytes": 65536}
    prefill("pool", shape=shape, seed=4)
    decode("pool", shape=shape)
    ticket = prefill("offer", requests=[list(range(0, 64, 2))])["tickets"][0]
    assert decode("pull", pulls=[[ticket, list(range(1, 64, 2))]])["results"][0]["ok"]
    time.sleep(0.5)
    pids = [d.proc.pid for d in (a, b) if d.proc is not None]
    before = [_cpu_seconds(pid) for pid in pids]
    time.sleep(2.0)
    used = [_cpu_seconds(pid) - b0 for pid, b0 in zip(pids, before, strict=True)]
    assert max(used) < 0.5, f"idle daemons used {used} CPU seconds in 2 s"
