"""A disaggregating proxy for vLLM engines that use the kvxfer connector (standard library only).

Each completion request goes twice: to a prefill engine with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}`` (the prompt is computed, its KV blocks are
offered through the prefill node's kvxferd, and the answer carries one ticket per TP rank),
then, unchanged but for the ``kv_transfer_params`` the prefill answered, to a decode engine,
whose kvxfer connector pulls the KV and generates. The decode engine's answer (streamed or
not) goes back to the client as it comes. Engines are taken round-robin.

    python -m examples.vllm_proxy --port 8000 \\
        --prefill http://prefill-host:8100 --decode http://decode-host:8200

Serves ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (from a
decode engine) and ``GET /health`` (200 only when every engine answers its own ``/health``).
A failed prefill is answered with its status and body and the header ``x-kvxfer-stage:
prefill``; nothing is sent to a decode engine then.

With ``--stream``, each request goes to both engines at once under a transfer id the proxy
draws (128 random bits): the prefill engine pushes the KV layer by layer as it computes it, to
the decode engine's kvxferd, whose peer address follows each ``--decode`` as
``--decode-kvxfer host:port`` (in the same order). A failed prefill then closes the decode
request (vLLM aborts it, and the connector cancels its wait) and answers as above.

    python -m examples.vllm_proxy --port 8000 --stream --prefill http://prefill-host:8100 \
        --decode http://decode-host:8200 --decode-kvxfer decode-host:7461
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import secrets
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Backends", "decode_body", "main", "prefill_body", "stream_bodies"]

log = logging.getLogger("kvxfer.proxy")

#: How long one engine may take to answer (a long generation streams within it).
TIMEOUT_S = 600.0
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: the prompt, one token, no streaming, KV kept for decode.

    >>> prefill_body({"prompt": [1, 2], "max_tokens": 50, "stream": True, "stream_options": {}})
    {'prompt': [1, 2], 'max_tokens': 1, 'stream': False, 'kv_transfer_params': {'do_remote_decode': True}}
    """
    out = {k: v for k, v in body.items() if k not in ("stream_options", "kv_transfer_params")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The decode engine's request: the client's, with the prefill's ``kv_transfer_params``.

    >>> decode_body({"prompt": [1, 2], "max_tokens": 50}, {"kv_transfer_params": {"kvxfer_tickets": []}})
    {'prompt': [1, 2], 'max_tokens': 50, 'kv_transfer_params': {'kvxfer_tickets': []}}
    """
    params = prefill_answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise ValueError(
            "the prefill engine answered without kv_transfer_params: is it started with "
            '--kv-transfer-config \'{"kv_connector": "KvxferConnector", ...}\' and a kv_role that produces?'
        )
    return {**body, "kv_transfer_params": params}


def stream_bodies(body: dict[str, Any], transfer_id: str, decode_peer: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two requests of a streamed handoff, sent at once: the prefill engine's pushes to
    ``decode_peer`` under ``transfer_id``, the decode engine's receives it.

    >>> prefill, decode = stream_bodies({"prompt": [1], "max_tokens": 9}, "t1", "10.0.0.2:7461")
    >>> prefill["max_tokens"], prefill["kv_transfer_params"]["kvxfer_stream"]["to_peer_address"]
    (1, '10.0.0.2:7461')
    >>> decode["max_tokens"], decode["kv_transfer_params"]
    (9, {'do_remote_prefill': True, 'kvxfer_stream': {'transfer_id': 't1'}})
    """
    prefill = prefill_body(body)
    stream = {"transfer_id": transfer_id, "to_peer_address": decode_peer}
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "kvxfer_stream": stream}
    kv = {"do_remote_prefill": True, "kvxfer_stream": {"transfer_id": transfer_id}}
    decode = {k: v for k, v in body.items() if k != "kv_transfer_params"} | {"kv_transfer_params": kv}
    return prefill, decode


class Backends:
    """The engines' base URLs, each role taken round-robin (a decode engine with its
    kvxferd's peer address, for streaming)."""

    def __init__(self, prefill: list[str], decode: list[str], decode_peers: list[str] | None = None) -> None:
        self.prefill, self.decode = prefill, decode
        self.decode_peers = dict(zip(decode, decode_peers or [], strict=False))
        self._next = {"prefill": itertools.cycle(prefill), "decode": itertools.cycle(decode)}
        self._lock = threading.Lock()

    def pick(self, role: str) -> str:
        with self._lock:
            return next(self._next[role])


def _connect(base: str) -> http.client.HTTPConnection:
    url = urllib.parse.urlsplit(base)
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    return cls(url.hostname or "127.0.0.1", url.port, timeout=TIMEOUT_S)


def _request(base: str, method: str, path: str, body: dict[str, Any] | None) -> http.client.HTTPResponse:
    """Send one request; the caller reads (and closes) the response."""
    conn = _connect(base)
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    conn.request(method, urllib.parse.urlsplit(base).path.rstrip("/") + path, body=data, headers=headers)
    return conn.getresponse()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), fmt % args)

    def do_GET(self) -> None:
        backends = self.server.backends
        if self.path == "/health":
            bad = [b for b in backends.prefill + backends.decode if not _healthy(b)]
            self._reply(503 if bad else 200, {"unhealthy": bad} if bad else {"status": "ok"})
        elif self.path == "/v1/models":
            with _request(backends.pick("decode"), "GET", self.path, None) as resp:
                self._relay(resp)
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        if self.path not in COMPLETION_PATHS:
            self._reply(404, {"error": f"no route {self.path}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as exc:
            self._reply(400, {"error": f"bad request body: {exc}"})
            return
        backends = self.server.backends
        if self.server.stream:
            self._streamed(body)
            return
        try:
            with _request(backends.pick("prefill"), "POST", self.path, prefill_body(body)) as resp:
                if resp.status != 200:
                    self._relay(resp, stage="prefill")
                    return
                answer = json.loads(resp.read())
            decode = decode_body(body, answer)
        except (OSError, ValueError) as exc:
            self._reply(502, {"error": f"prefill: {exc}"}, stage="prefill")
            return
        try:
            with _request(backends.pick("decode"), "POST", self.path, decode) as resp:
                self._relay(resp, stage="decode")
        except OSError as exc:
            if not self.wfile.closed:
                self._reply(502, {"error": f"decode: {exc}"}, stage="decode")

    def _streamed(self, body: dict[str, Any]) -> None:
        """Both engines at once: the decode request waits for the KV the prefill pushes."""
        backends = self.server.backends
        decode_url = backends.pick("decode")
        prefill, decode = stream_bodies(body, secrets.token_hex(16), backends.decode_peers[decode_url])
        conn = _connect(decode_url)
        data = json.dumps(decode).encode()
        path = urllib.parse.urlsplit(decode_url).path.rstrip("/") + self.path
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        except OSError as exc:
            conn.close()
            self._reply(502, {"error": f"decode: {exc}"}, stage="decode")
            return
        prefill_url = backends.pick("prefill")
        prefilled: Future[tuple[int, bytes]] = self.server.pool.submit(_post, prefill_url, self.path, prefill)
        try:
            status, answer = prefilled.result()
        except OSError as exc:
            status, answer = 502, json.dumps({"error": f"prefill: {exc}"}).encode()
        if status != 200:
            conn.close()  # vLLM aborts the decode request; its connector stops waiting
            self._reply_raw(status, answer, stage="prefill")
            return
        try:
            with conn.getresponse() as resp:
                self._relay(resp, stage="decode")
        except OSError as exc:
            if not self.wfile.closed:
                self._reply(502, {"error": f"decode: {exc}"}, stage="decode")
        finally:
            conn.close()

    def _reply(self, status: int, obj: dict[str, Any], stage: str | None = None) -> None:
        self._reply_raw(status, json.dumps(obj).encode(), stage)

    def _reply_raw(self, status: int, data: bytes, stage: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if stage:
            self.send_header("x-kvxfer-stage", stage)
        self.end_headers()
        self.wfile.write(data)

    def _relay(self, resp: http.client.HTTPResponse, stage: str | None = None) -> None:
        """Pass an engine's answer through, chunk by chunk (a stream stays a stream)."""
        self.send_response(resp.status)
        for name in ("Content-Type",):
            if resp.getheader(name):
                self.send_header(name, resp.getheader(name, ""))
        if stage:
            self.send_header("x-kvxfer-stage", stage)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in _chunks(resp):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


def _chunks(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while chunk := resp.read1(64 << 10):
        yield chunk


def _post(base: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    with _request(base, "POST", path, body) as resp:
        return resp.status, resp.read()


def _healthy(base: str) -> bool:
    try:
        with _request(base, "GET", "/health", None) as resp:
            resp.read()
            return resp.status == 200
    except OSError:
        return False


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], backends: Backends, stream: bool = False) -> None:
        super().__init__(address, _Handler)
        self.backends = backends
        self.stream = stream
        #: Streamed requests' prefill halves, sent beside their decode halves.
        self.pool = ThreadPoolExecutor(64, thread_name_prefix="prefill")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.vllm_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", required=True, help="a prefill engine's base URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="a decode engine's base URL (repeatable)")
    parser.add_argument(
        "--decode-kvxfer",
        action="append",
        default=[],
        help="with --stream: the peer address (host:port) of each --decode engine's kvxferd, in the same order",
    )
    parser.add_argument("--stream", action="store_true", help="send to both engines at once; the prefill pushes")
    args = parser.parse_args(argv)
    if args.stream and len(args.decode_kvxfer) != len(args.decode):
        parser.error("--stream needs one --decode-kvxfer (the decode node's kvxferd peer address) per --decode")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    server = _Server((args.host, args.port), Backends(args.prefill, args.decode, args.decode_kvxfer), args.stream)
    log.info(
        "kvxfer proxy on %s:%d: prefill %s, decode %s (%s)",
        args.host,
        server.server_port,
        args.prefill,
        args.decode,
        "streaming: both at once, the prefill pushes" if args.stream else "prefill, then decode pulls",
    )
    print(json.dumps({"port": server.server_port}), flush=True)  # with --port 0: where it listens
    server.serve_forever()


if __name__ == "__main__":
    main()
