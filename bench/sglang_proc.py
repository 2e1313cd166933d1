"""An SGLang worker (``bench.sglang_rank``, ``bench.sglang_hicache``) in a process of its own,
driven over stdin: commands and answers are JSON lines, answers start with ``@@`` (never
pickle)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Any

from bench.cluster import ROOT, Daemon, _env

__all__ = ["SglangProcess", "serve"]


class SglangProcess:
    """A worker of this file's kind (``module``) in a process of its own, on ``daemon``;
    ``proc(op, **kwargs)`` runs a command and returns its result."""

    def __init__(self, module: str, argv: list[str], daemon: Daemon, name: str) -> None:
        self.name = name
        self.daemon = daemon
        self.log_path = os.path.join(daemon.workdir, f"sglang-{self.name}.log")
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=_env({"KVXFER_SOCKET": daemon.socket}),
            cwd=ROOT,
        )
        log.close()
        hello = self._read()
        if not hello.get("ready"):
            raise RuntimeError(
                f"SGLang worker {self.name} did not start: {hello.get('error')}\n{hello.get('trace', '')}"
            )

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"SGLang worker {self.name} exited ({self.proc.poll()}):\n{self.log()}")
            if line.startswith(b"@@"):
                reply: dict[str, Any] = json.loads(line[2:])
                return reply

    def __call__(self, op: str, **kwargs: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kwargs}) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"SGLang worker {self.name} {op}: {reply['error']}\n{reply.get('trace', '')}")
        return reply["result"]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()[-8000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(60)


def serve(worker: Any) -> None:
    """Answer commands on stdin (JSON lines; answers start with ``@@``) until it closes."""
    print("@@" + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            result = getattr(worker, cmd.pop("op"))(**cmd)
            print("@@" + json.dumps({"result": result}), flush=True)
        except Exception as exc:  # noqa: BLE001 - a command's failure is its answer
            print(
                "@@" + json.dumps({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}),
                flush=True,
            )
    os._exit(0)  # SGLang's threads (bootstrap server, ZMQ) are not ours to join
