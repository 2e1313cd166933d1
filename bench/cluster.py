"""Start real kvxferd daemons and engine processes on this machine (demo, bench, tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The interpreter daemons run under: this one, unless ``KVXFER_DAEMON_PYTHON`` names another
#: (the vLLM tests run in a venv without UCX; their daemons run from the main one).
DAEMON_PYTHON = os.environ.get("KVXFER_DAEMON_PYTHON") or sys.executable


#: How long a SIGKILLed process may take to be reaped: the kernel first tears its memory down,
#: which took over 10 s once on a VM whose disk was busy (make test builds the vLLM venv beside
#: the suite).
KILL_REAP_S = 60.0


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    env.update(extra or {})
    return env


@dataclass
class Daemon:
    name: str
    workdir: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: Words before the command, e.g. ``["ip", "netns", "exec", "ns1"]``.
    prefix: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def socket(self) -> str:
        return os.path.join(self.workdir, f"{self.name}.sock")

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, f"{self.name}.log")

    def start(self, timeout_s: float = 30.0) -> Daemon:
        ready = os.path.join(self.workdir, f"{self.name}.ready.json")
        if os.path.exists(ready):
            os.unlink(ready)
        cmd = [
            *self.prefix,
            DAEMON_PYTHON,
            "-m",
            "kvxferd",
            "--engine-socket",
            self.socket,
            "--peer-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--daemon-id",
            self.name,
            "--ready-file",
            ready,
            *self.args,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(self.env), cwd=ROOT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} not ready after {timeout_s}s:\n{self.log()}")
            time.sleep(0.05)
        with open(ready) as fh:
            self.info = json.load(fh)
        return self

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return fh.read()[-20000:]
        except FileNotFoundError:
            return ""

    def admin(self, method: str, request: Any) -> Any:
        """One AdminService call over the daemon's Unix socket (``Status``, ``ListTier``, ...)."""
        import grpc

        from kvxfer.proto import admin_pb2_grpc

        with grpc.insecure_channel("unix:" + self.socket) as channel:
            return getattr(admin_pb2_grpc.AdminServiceStub(channel), method)(request, timeout=5)

    def metric(self, name: str) -> float:
        """The sum of a metric's samples over all its labels (0 when it has none yet); a name
        with labels (``m{l="v"}``, as exposed) is that one series."""
        import urllib.request

        with urllib.request.urlopen(f"http://{self.info['metrics_address']}/metrics", timeout=5) as resp:
            lines = resp.read().decode().splitlines()
        if "{" in name:
            return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(name + " "))
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.split("{")[0].split(" ")[0] == name)

    def transfer(self, transfer_id: str) -> Any:
        """The daemon's record of one transfer, running or finished (``TransferInfo``)."""
        from kvxfer.proto import admin_pb2

        listed = self.admin("ListTransfers", admin_pb2.ListTransfersRequest(include_finished=True))
        [row] = [t for t in listed.transfers if t.transfer_id == transfer_id]
        return row

    async def settled(self, timeout_s: float = 10.0) -> Any:
        """The daemon's ``Status`` once it holds no offer or transfer (or the last one seen)."""
        import asyncio

        import grpc

        from kvxfer.proto import admin_pb2, admin_pb2_grpc

        deadline = time.monotonic() + timeout_s
        async with grpc.aio.insecure_channel("unix:" + self.socket) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            while True:
                s = await stub.Status(admin_pb2.StatusRequest(), timeout=5)
                if (s.active_offers, s.active_transfers) == (0, 0) or time.monotonic() > deadline:
                    return s
                await asyncio.sleep(0.05)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain) and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(KILL_REAP_S)


class EngineProcess:
    """An engine process attached to one daemon, driven by JSON lines on its stdin.

    ``module`` is ``bench.engine`` (the benchmark engine) unless another engine is named; it
    gets ``--socket <daemon socket>`` and then ``args``. ``prefix`` comes before the command
    (e.g. ``setpriv`` to run as another user); ``popen`` goes to :class:`subprocess.Popen`
    (e.g. ``umask``).
    """

    def __init__(
        self,
        daemon: Daemon,
        name: str,
        module: str = "bench.engine",
        args: list[str] | None = None,
        popen: dict[str, Any] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.name = name
        extra = ["--name", name] if args is None else args
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", module, "--socket", daemon.socket, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_env(),
            cwd=ROOT,
            **(popen or {}),
        )
        hello = self._read()
        if not hello.get("ready"):
            raise RuntimeError(f"engine {name} failed to start: {hello}")
        self.session_id = hello.get("session_id", "")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {self.name} exited ({self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kwargs}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read()

    def __call__(self, op: str, **kwargs: Any) -> dict[str, Any]:
        reply = self.call(op, **kwargs)
        if not reply.get("ok"):
            raise RuntimeError(f"engine {self.name} {op} failed: {reply}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit")
            except (BrokenPipeError, RuntimeError, ValueError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(KILL_REAP_S)


class Cluster:
    """Daemons and engines in a scratch directory, all stopped on exit."""

    def __init__(self, workdir: str | None = None) -> None:
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="kvxfer-")
        self.workdir = workdir or (self._tmp.name if self._tmp else "")
        self.daemons: list[Daemon] = []
        self.engines: list[EngineProcess] = []

    def daemon(
        self, name: str, *args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None
    ) -> Daemon:
        d = Daemon(name, self.workdir, list(args), env or {}, prefix or []).start()
        self.daemons.append(d)
        return d

    def engine(
        self,
        daemon: Daemon,
        name: str,
        module: str = "bench.engine",
        args: list[str] | None = None,
        popen: dict[str, Any] | None = None,
        prefix: list[str] | None = None,
    ) -> EngineProcess:
        e = EngineProcess(daemon, name, module, args, popen, prefix)
        self.engines.append(e)
        return e

    def close(self) -> None:
        for e in self.engines:
            e.close()
        for d in self.daemons:
            try:
                d.terminate(30)
            except Exception:  # noqa: BLE001 - make sure nothing outlives the cluster
                d.kill()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``condition`` (every 20 ms) until it holds; AssertionError naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
