"""Network faults between two daemons in two network namespaces joined by a veth pair.

Runs as root only (it creates namespaces); skipped cleanly otherwise. The daemons are forced
onto UCX's TCP transport with endpoint error handling (as between two hosts), so the bytes
really cross the veth. Faults: a partition (the link goes down mid-transfer, then comes back)
and, where the kernel has the netem qdisc, delay and loss.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from bench.cluster import Cluster, Daemon

DEADLINE_S = 5.0
SHAPE = {"layers": 2, "blocks": 64, "block_bytes": 128 << 10}
UCX_TCP = {"UCX_TLS": "tcp,self", "UCX_TCP_CM_REUSEADDR": "y"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Veth:
    """Namespaces ``a`` and ``b``, 10.77.x.1 and 10.77.x.2 on a veth pair."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = {"a": f"kvx-a-{tag}", "b": f"kvx-b-{tag}"}
        self.dev = {"a": f"kva{tag}", "b": f"kvb{tag}"}
        self.addr = {"a": "10.77.9.1", "b": "10.77.9.2"}
        for side in ("a", "b"):
            _ip("netns", "add", self.ns[side])
        _ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
        for side in ("a", "b"):
            _ip("link", "set", self.dev[side], "netns", self.ns[side])
            _ip("-n", self.ns[side], "addr", "add", f"{self.addr[side]}/24", "dev", self.dev[side])
            _ip("-n", self.ns[side], "link", "set", self.dev[side], "up")
            _ip("-n", self.ns[side], "link", "set", "lo", "up")

    def prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def link(self, up: bool) -> None:
        _ip("-n", self.ns["a"], "link", "set", self.dev["a"], "up" if up else "down")

    def netem(self, spec: str) -> bool:
        """Apply a netem qdisc on side a; False when the kernel has no netem."""
        cmd = ["ip", "netns", "exec", self.ns["a"], "tc", "qdisc", "replace", "dev", self.dev["a"], "root", "netem"]
        return subprocess.run([*cmd, *spec.split()], capture_output=True, check=False).returncode == 0

    def close(self) -> None:
        for side in ("a", "b"):
            _ip("netns", "del", self.ns[side], check=False)


def _can_make_namespaces() -> str:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip"):
        return "needs iproute2 (ip)"
    probe = f"kvx-probe-{uuid.uuid4().hex[:6]}"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return "cannot create network namespaces here"
    _ip("netns", "del", probe, check=False)
    return ""


@pytest.fixture(scope="module")
def veth() -> Iterator[Veth]:
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    v = Veth()
    try:
        yield v
    finally:
        v.close()


@pytest.fixture(scope="module")
def netcluster(veth: Veth) -> Iterator[tuple[Cluster, Daemon, Daemon]]:
    args = ("--ucx-error-handling", "on", "--peer-timeout-s", "2")
    with Cluster() as cluster:
        a = cluster.daemon("a", *args, "--peer-listen", f"{veth.addr['a']}:0", env=UCX_TCP, prefix=veth.prefix("a"))
        b = cluster.daemon("b", *args, "--peer-listen", f"{veth.addr['b']}:0", env=UCX_TCP, prefix=veth.prefix("b"))
        yield cluster, a, b


def handoff(cluster: Cluster, a: Daemon, b: Daemon, name: str, blocks: int, timeout_s: float) -> dict[str, Any]:
    prefill, decode = cluster.engine(a, f"p-{name}"), cluster.engine(b, f"d-{name}")
    prefill("pool", shape=SHAPE, seed=3)
    decode("pool", shape=SHAPE)
    ids = list(range(blocks))
    ticket = prefill("offer", requests=[ids], lease_s=60)["tickets"][0]
    t0 = time.monotonic()
    result = decode("pull", pulls=[[ticket, ids[::-1]]], timeout_s=timeout_s)["results"][0]
    result["waited_s"] = time.monotonic() - t0
    if result["ok"]:
        result["verified"] = decode("verify", seed=3, pairs=[[ids, ids[::-1]]])["verified"]
    return result


def test_bytes_cross_the_veth_over_tcp_lanes(netcluster: tuple[Cluster, Daemon, Daemon]) -> None:
    """UCX has only TCP between the two namespaces: host blocks take the TCP lanes (the
    default, tcp_lanes: auto), which connect to the address the decode daemon dialled."""
    cluster, a, b = netcluster
    result = handoff(cluster, a, b, "plain", 16, DEADLINE_S)
    assert result["ok"] and result["verified"], result
    assert result["transport"] == "tcp-lanes:4"
    assert "transport.tcp_lanes" in b.log()


def test_bytes_cross_the_veth_over_ucx_tcp(veth: Veth, netcluster: tuple[Cluster, Daemon, Daemon]) -> None:
    """With the lanes off, UCX's own TCP transport carries them."""
    cluster, _, b = netcluster
    a = cluster.daemon(
        "a-no-lanes",
        *("--ucx-error-handling", "on", "--peer-timeout-s", "2"),
        *("--tcp-lanes", "off", "--peer-listen", f"{veth.addr['a']}:0"),
        env=UCX_TCP,
        prefix=veth.prefix("a"),
    )
    result = handoff(cluster, a, b, "plain-ucx", 16, DEADLINE_S)
    assert result["ok"] and result["verified"], result
    assert result["transport"] == "ucx:tcp"


def test_a_partition_mid_transfer_fails_within_the_deadline_and_the_link_heals(
    veth: Veth, netcluster: tuple[Cluster, Daemon, Daemon]
) -> None:
    cluster, _, b = netcluster
    # Its own prefill daemon, paused once its first chunk is out: the link goes down while
    # the rest of the bytes are due, every time.
    a = cluster.daemon(
        "a-partition",
        *("--ucx-error-handling", "on", "--peer-timeout-s", "2", "--chunk-bytes", str(1 << 20), "--window", "1"),
        *("--fault-injection", "--faults", "after_chunk_sent:0=pause:1"),
        *("--peer-listen", f"{veth.addr['a']}:0"),
        env=UCX_TCP,
        prefix=veth.prefix("a"),
    )
    outcome: dict[str, Any] = {}
    pulling = threading.Thread(target=lambda: outcome.update(handoff(cluster, a, b, "partition", 64, DEADLINE_S)))
    pulling.start()
    try:
        deadline = time.monotonic() + 30
        while "fault.hit" not in a.log():
            assert time.monotonic() < deadline and pulling.is_alive(), a.log()[-3000:]
            time.sleep(0.01)
        veth.link(False)
        pulling.join(DEADLINE_S + 10)
    finally:
        veth.link(True)
    assert not pulling.is_alive(), "the pull did not end"
    assert not outcome["ok"], "the pull succeeded across a partition"
    assert outcome["type"] in ("DeadlineExceededError", "UnavailableError"), outcome
    assert outcome["waited_s"] < DEADLINE_S + 2.0
    # Once the link is back, pulls work again (a new Hello and endpoint where needed).
    deadline = time.monotonic() + 30
    while True:
        again = handoff(cluster, a, b, "healed", 8, DEADLINE_S)
        if again["ok"] or time.monotonic() > deadline:
            break
    assert again["ok"] and again["verified"], again


def test_delay_and_loss_slow_the_transfer_but_it_arrives_exact(
    veth: Veth, netcluster: tuple[Cluster, Daemon, Daemon]
) -> None:
    if not veth.netem("delay 5ms loss 1%"):
        pytest.skip("this kernel has no netem qdisc (sch_netem)")
    try:
        result = handoff(cluster=netcluster[0], a=netcluster[1], b=netcluster[2], name="netem", blocks=16, timeout_s=30)
    finally:
        subprocess.run([*veth.prefix("a"), "tc", "qdisc", "del", "dev", veth.dev["a"], "root"], check=False)
    assert result["ok"] and result["verified"], result
