"""Real etcd servers on loopback for the fleet tests and the demo: one member, or a cluster of
three (Debian's ``etcd-server`` package: ``make etcd`` installs it).

Each member gets its own data directory and free ports; :meth:`EtcdCluster.kill` and
:meth:`EtcdCluster.start` stop and bring back one member, :meth:`EtcdCluster.leader` says
which one leads.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cluster import Cluster, Daemon

__all__ = ["TTL_S", "EtcdCluster", "etcd_missing", "handoff", "registry_args"]

#: The fleet tests' lease: short, to keep the suite quick (the daemon's default is 10 s).
TTL_S = 5
SHAPE = {"layers": 2, "blocks": 32, "block_bytes": 16 << 10}


def etcd_missing() -> str:
    """Why no etcd server can run here ("" when one can)."""
    if not shutil.which("etcd"):
        return "needs Debian's etcd-server package (make etcd installs it)"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: str
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"


class EtcdCluster:
    """``size`` etcd members on loopback, stopped (and their data removed) on exit."""

    def __init__(self, size: int = 1, host: str = "127.0.0.1") -> None:
        self.host = host
        self._tmp = tempfile.TemporaryDirectory(prefix="kvxfer-etcd-")
        self.members = [
            _Member(f"m{i}", _free_port(), _free_port(), os.path.join(self._tmp.name, f"m{i}"), host)
            for i in range(size)
        ]
        self._initial = ",".join(f"{m.name}=http://{host}:{m.peer_port}" for m in self.members)
        for m in self.members:
            self.start(m.name)
        self.wait_healthy()

    @property
    def url(self) -> str:
        """The registry setting for a daemon: ``etcd://`` and every member."""
        return "etcd://" + ",".join(f"{self.host}:{m.client_port}" for m in self.members)

    def member(self, name: str) -> _Member:
        return next(m for m in self.members if m.name == name)

    def start(self, name: str) -> None:
        m = self.member(name)
        state = "existing" if os.path.exists(m.data_dir) else "new"
        cmd = [
            "etcd",
            *("--name", m.name, "--data-dir", m.data_dir),
            *("--listen-client-urls", f"http://{self.host}:{m.client_port}"),
            *("--advertise-client-urls", f"http://{self.host}:{m.client_port}"),
            *("--listen-peer-urls", f"http://{self.host}:{m.peer_port}"),
            *("--initial-advertise-peer-urls", f"http://{self.host}:{m.peer_port}"),
            *("--initial-cluster", self._initial, "--initial-cluster-state", state),
            *("--initial-cluster-token", os.path.basename(self._tmp.name)),
            # A lost leader is noticed within a second or so (defaults: 100 ms / 1 s).
            *("--heartbeat-interval", "100", "--election-timeout", "1000"),
            "--log-level",
            "warn",
        ]
        log = open(os.path.join(self._tmp.name, f"{m.name}.log"), "ab")  # noqa: SIM115 - the child keeps it
        m.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        m = self.member(name)
        if m.proc is not None and m.proc.poll() is None:
            m.proc.send_signal(sig)
            m.proc.wait(30)

    def stop_all(self) -> None:
        for m in self.members:
            self.kill(m.name, signal.SIGTERM)

    def start_all(self) -> None:
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                self.start(m.name)
        self.wait_healthy()

    def ctl(self, *args: str, endpoints: list[str] | None = None) -> str:
        """``etcdctl`` (API v3) against the members (or ``endpoints``); its stdout."""
        eps = ",".join(endpoints or [m.endpoint for m in self.members if m.proc and m.proc.poll() is None])
        out = subprocess.run(
            ["etcdctl", "--endpoints", eps, "--dial-timeout", "2s", "--command-timeout", "5s", *args],
            capture_output=True,
            text=True,
            env=dict(os.environ, ETCDCTL_API="3"),
            check=True,
        )
        return out.stdout

    def leader(self) -> str:
        """The name of the member that leads now."""
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            status = json.loads(self.ctl("endpoint", "status", "-w", "json", endpoints=[m.endpoint]))[0]["Status"]
            if status["leader"] == status["header"]["member_id"]:
                return m.name
        raise RuntimeError("no etcd member leads")

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.ctl("get", prefix, "--prefix", "--keys-only").splitlines() if k]

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.ctl("put", "/kvxfer-test/health", "ok")
                return
            except subprocess.CalledProcessError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd not healthy after {timeout_s}s: {exc.stderr}") from None
                time.sleep(0.2)

    def close(self) -> None:
        for m in self.members:
            self.kill(m.name)
        self._tmp.cleanup()

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def registry_args(etcd: EtcdCluster, cluster: str = "t", ttl_s: int = TTL_S) -> list[str]:
    """A daemon's flags to register in ``etcd`` under ``cluster``."""
    return ["--registry", etcd.url, "--cluster", cluster, "--registry-ttl-s", str(ttl_s)]


def handoff(
    cluster: Cluster, src: Daemon, dst: Daemon, name: str, blocks: int = 4, timeout_s: float = 20.0
) -> dict[str, Any]:
    """One verified handoff of ``blocks`` blocks from an engine on ``src`` to one on ``dst``."""
    prefill, decode = cluster.engine(src, f"p-{name}"), cluster.engine(dst, f"d-{name}")
    prefill("pool", shape=SHAPE, seed=5)
    decode("pool", shape=SHAPE)
    ids = list(range(blocks))
    ticket = prefill("offer", requests=[ids], lease_s=60)["tickets"][0]
    started = time.monotonic()
    result: dict[str, Any] = decode("pull", pulls=[[ticket, ids[::-1]]], timeout_s=timeout_s)["results"][0]
    result["waited_s"] = time.monotonic() - started
    if result["ok"]:
        result["verified"] = decode("verify", seed=5, pairs=[[ids, ids[::-1]]])["verified"]
    prefill.close()
    decode.close()
    return result
