"""A prefill node that vanishes mid-pull without a reset: its network namespace is cut off (no
RST, no FIN: its packets just stop). Without the registry the decode daemon learns it only at
the pull's deadline; with it, once the node's lease lapses (its keep-alives stopped too).

Runs as root only (it makes a network namespace); skipped cleanly otherwise.
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
from bench.etcd import TTL_S, EtcdCluster, handoff, registry_args

PULL_DEADLINE_S = 12.0
UCX_TCP = {"UCX_TLS": "tcp,self", "UCX_TCP_CM_REUSEADDR": "y"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Namespace:
    """Namespace ``ns`` (10.79.n.2) joined to this one (10.79.n.1) by a veth pair."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns, self.outer_dev, self.inner_dev = f"kvx-f-{tag}", f"kvo{tag}", f"kvi{tag}"
        net = int(tag[:2], 16)  # a subnet of its own: two runs on one machine do not collide
        self.outer, self.inner = f"10.79.{net}.1", f"10.79.{net}.2"
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.outer_dev, "type", "veth", "peer", "name", self.inner_dev)
        _ip("link", "set", self.inner_dev, "netns", self.ns)
        _ip("addr", "add", f"{self.outer}/24", "dev", self.outer_dev)
        _ip("link", "set", self.outer_dev, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.inner}/24", "dev", self.inner_dev)
        _ip("-n", self.ns, "link", "set", self.inner_dev, "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def link(self, up: bool) -> None:
        _ip("-n", self.ns, "link", "set", self.inner_dev, "up" if up else "down")

    def close(self) -> None:
        _ip("link", "del", self.outer_dev, check=False)
        _ip("netns", "del", self.ns, check=False)


@pytest.fixture(scope="module")
def namespace() -> Iterator[Namespace]:
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to make a network namespace")
    probe = f"kvx-probe-{uuid.uuid4().hex[:6]}"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        pytest.skip("cannot create network namespaces here")
    _ip("netns", "del", probe, check=False)
    ns = Namespace()
    try:
        yield ns
    finally:
        ns.close()


def _cut_mid_pull(cluster: Cluster, ns: Namespace, prefill: Daemon, decode: Daemon) -> dict[str, Any]:
    """A pull from ``prefill`` (inside the namespace, paused once it accepted the transfer);
    the namespace is cut off then. Returns the pull's result and the seconds from the cut."""
    outcome: dict[str, Any] = {}
    pulling = threading.Thread(
        target=lambda: outcome.update(handoff(cluster, prefill, decode, prefill.name, 8, PULL_DEADLINE_S))
    )
    pulling.start()
    try:
        deadline = time.monotonic() + 30
        while "fault.hit" not in prefill.log():
            assert time.monotonic() < deadline and pulling.is_alive(), prefill.log()[-3000:]
            time.sleep(0.01)
        ns.link(False)
        cut = time.monotonic()
        pulling.join(PULL_DEADLINE_S + 30)
        outcome["after_cut_s"] = time.monotonic() - cut
    finally:
        ns.link(True)
    assert not pulling.is_alive(), "the pull did not end"
    return outcome


def _daemons(cluster: Cluster, ns: Namespace, extra: list[str], tag: str) -> tuple[Daemon, Daemon]:
    common = ["--ucx-error-handling", "on", "--pull-timeout-s", str(PULL_DEADLINE_S), *extra]
    prefill = cluster.daemon(
        f"pre-{tag}",
        *common,
        *("--peer-listen", f"{ns.inner}:0", "--fault-injection", "--faults", "after_accepted=pause:60"),
        env=UCX_TCP,
        prefix=ns.prefix(),
    )
    decode = cluster.daemon(f"dec-{tag}", *common, "--peer-listen", f"{ns.outer}:0", env=UCX_TCP)
    return prefill, decode


@pytest.mark.parametrize("transport", ["tcp-lanes", "ucx"])
def test_a_node_cut_off_mid_pull_fails_the_pull_within_a_lease_with_the_registry(
    namespace: Namespace, transport: str
) -> None:
    """Over UCX nothing notices the silence before the pull's deadline; TCP lanes notice it
    when a lane read waits peer_timeout_s (5 s) in vain. The registry bounds both by the lease."""
    lanes = [] if transport == "tcp-lanes" else ["--tcp-lanes", "off"]
    with EtcdCluster(1, host=namespace.outer) as etcd, Cluster() as cluster:
        without = _cut_mid_pull(cluster, namespace, *_daemons(cluster, namespace, lanes, "plain"))
        prefill, decode = _daemons(cluster, namespace, [*lanes, *registry_args(etcd, "cut")], "reg")
        with_registry = _cut_mid_pull(cluster, namespace, prefill, decode)
        print(
            f"\n{transport}: a pull from a node cut off mid-pull failed {without['after_cut_s']:.2f}s after the cut "
            f"without the registry ({without.get('type')}: {without.get('error', '')[:80]}), "
            f"{with_registry['after_cut_s']:.2f}s with it; ttl {TTL_S}s, pull deadline {PULL_DEADLINE_S:g}s"
        )
        assert not without["ok"] and without["type"] in ("DeadlineExceededError", "UnavailableError"), without
        if transport == "ucx":
            assert without["after_cut_s"] > PULL_DEADLINE_S / 2, without
        assert not with_registry["ok"] and with_registry["type"] == "UnavailableError", with_registry
        if transport == "ucx":  # only the registry notices there; lanes may race it (their own timeouts)
            assert "left cluster 'cut'" in with_registry["error"], with_registry
        assert with_registry["after_cut_s"] < TTL_S + 2, with_registry
        # The node comes back: it registers again and pulls from it work.
        deadline = time.monotonic() + 60
        while "registry.state state=registered was=unreachable" not in prefill.log():
            assert time.monotonic() < deadline, prefill.log()[-3000:]
            time.sleep(0.1)
