"""The floor of a handoff's fixed cost: its control messages on grpc.aio with no work behind them.

``bench.lean``'s ``fixed`` figure sets a 4 KiB handoff (an offer in the prefill engine, then
its pull in the decode engine) against two unary gRPC echoes of the same run. This measures
what the handoff's messages alone cost in the same layout, every daemon and engine its own
process, driven the same way (JSON lines on each engine's stdin): two "daemons" on uvloop,
each serving a ``Calls`` stream on a Unix socket and a ``Peer`` stream on TCP, and three
"engines" on asyncio. Nothing is checked, planned, copied or logged:

* ``offer``: the prefill engine writes one message on its ``Calls`` stream to daemon a,
  which answers it at once;
* ``local`` pull: another engine of daemon a does the same;
* ``remote`` pull: an engine of daemon b writes on its ``Calls`` stream; daemon b writes one
  message on its ``Peer`` stream to daemon a, which answers at once, and then answers the
  engine (the six messages of a remote handoff with the offer: offer and answer, pull and
  answer, ``start`` and ``accepted``);
* ``echo``: four unary echoes one after the other from the local engine to daemon a, counted
  in pairs, as ``bench.lean`` counts them.

Whatever a real handoff costs above this floor is the work of the daemons and the SDK.

Run: ``python -m bench.grpc_floor [--rounds 300]``; one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import uvloop

SERVICE = "kvxfer.bench.Floor"


def _bytes(b: bytes) -> bytes:
    return b


def daemon_main(socket: str, peer_port: int) -> None:
    """A daemon with no work: ``Calls`` answered at once, or (``peer_port``) after one
    message each way on a ``Peer`` stream to the daemon there."""

    async def main() -> None:
        waiting: dict[bytes, asyncio.Future[bytes]] = {}
        peer: Any = None
        if peer_port:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer_port}")
            peer = channel.stream_stream(f"/{SERVICE}/Peer", request_serializer=_bytes, response_deserializer=_bytes)()

            async def read_peer() -> None:
                while (message := await peer.read()) is not grpc.aio.EOF:
                    waiting.pop(message).set_result(message)

            reader = asyncio.create_task(read_peer())

        async def calls(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for request in requests:
                if peer is not None:
                    # Held here: the answer may arrive (and leave ``waiting``) before write returns.
                    answered = waiting[request] = asyncio.get_running_loop().create_future()
                    await peer.write(request)
                    await answered
                yield request

        async def echo_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for request in requests:
                yield request

        async def unary(request: bytes, context: Any) -> bytes:
            return request

        handlers = {
            "Calls": grpc.stream_stream_rpc_method_handler(calls, _bytes, _bytes),
            "Peer": grpc.stream_stream_rpc_method_handler(echo_stream, _bytes, _bytes),
            "Echo": grpc.unary_unary_rpc_method_handler(unary, _bytes, _bytes),
        }
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_insecure_port(f"unix:{socket}")
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()
        if peer_port:
            reader.cancel()

    uvloop.run(main())


def engine_main(socket: str) -> None:
    """An engine: ``call`` (one message each way on its ``Calls`` stream) and ``echo``
    (``count`` unary echoes), each line of stdin answered with its seconds."""

    async def main() -> None:
        channel = grpc.aio.insecure_channel(f"unix:{socket}")
        calls = channel.stream_stream(f"/{SERVICE}/Calls", request_serializer=_bytes, response_deserializer=_bytes)()
        echo = channel.unary_unary(f"/{SERVICE}/Echo", request_serializer=_bytes, response_deserializer=_bytes)
        loop, n = asyncio.get_running_loop(), 0
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["op"] == "call":
                n += 1
                t0 = time.perf_counter()
                await calls.write(n.to_bytes(8, "little"))
                await calls.read()
                reply: Any = time.perf_counter() - t0
            else:
                reply = []
                for _ in range(cmd["count"]):
                    t0 = time.perf_counter()
                    await echo(b"x")
                    reply.append(time.perf_counter() - t0)
            print(json.dumps(reply), flush=True)

    asyncio.run(main())


class _Engine:
    def __init__(self, socket: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.grpc_floor", "engine", socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())


def run(rounds: int) -> dict[str, Any]:
    """The floor's figures: medians over ``rounds`` rounds (after two to warm up)."""
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            port = 0
            for name in ("a", "b"):
                procs.append(_spawn(["daemon", f"{tmp}/{name}.sock", str(port)]))
                assert procs[-1].stdout is not None
                port = int(procs[-1].stdout.readline())
            prefill, local, remote = (_Engine(f"{tmp}/{d}.sock") for d in ("a", "a", "b"))
            procs += [prefill.proc, local.proc, remote.proc]
            rows: dict[str, list[float]] = {"echo2": [], "local": [], "remote": []}
            for r in range(rounds + 2):
                e = local(op="echo", count=4)
                local_s = prefill(op="call") + local(op="call")
                remote_s = prefill(op="call") + remote(op="call")
                if r >= 2:
                    rows["echo2"] += [e[0] + e[1], e[2] + e[3]]
                    rows["local"].append(local_s)
                    rows["remote"].append(remote_s)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    echo2 = statistics.median(rows["echo2"])
    return {
        "figure": "floor",
        "echo2_p50_ms": echo2 * 1e3,
        "local_p50_ms": statistics.median(rows["local"]) * 1e3,
        "remote_p50_ms": statistics.median(rows["remote"]) * 1e3,
        "local_vs_echo2": statistics.median(rows["local"]) / echo2,
        "remote_vs_echo2": statistics.median(rows["remote"]) / echo2,
    }


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", *args], stdout=subprocess.PIPE, text=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "daemon":
        daemon_main(sys.argv[2], int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        engine_main(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    print(json.dumps(run(args.rounds)), flush=True)


if __name__ == "__main__":
    main()
