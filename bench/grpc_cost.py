"""What a control message costs on grpc.aio, and what the alternatives that keep gRPC give.

A remote handoff's fixed cost is its control messages (peer.proto's Transfers stream): this
measures one message's cost in isolation, between two processes on this host over TCP (as
two daemons' peer ports), every figure in one run, rounds interleaved:

* ``unary``: a unary echo; ``stream``: one message each way on an open bidi stream (the
  Transfers pattern), for payloads of 64 B, 4 KiB and 64 KiB;
* ``loop``: the stream echo with the serving process on asyncio's own loop instead of uvloop;
* ``burst``: 64 messages written back to back and their 64 echoes, per message, against one
  message carrying all 64 payloads (what coalescing concurrent transfers' messages buys);
* ``busy``: the stream echo while the serving process's event loop is busy (a task that
  holds it 0.5 ms of every 1 ms, as a daemon moving bytes and serving engines does), with the
  stream served on that loop and on a loop of its own in a second thread;
* ``core``: the stream echo between two processes that both run gRPC's core with its
  EventEngine client and listener off (``GRPC_EXPERIMENTS``, read when gRPC loads) against two
  on gRPC's own defaults, blocks of echoes alternated.

Run: ``python -m bench.grpc_cost [--rounds 400]``; one JSON line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import uvloop

SERVICE = "kvxfer.bench.Echo"
SIZES = (64, 4096, 65536)
BURST = 64
#: gRPC core experiments turned off (a leading "-"): its newer I/O layer, EventEngine.
EVENT_ENGINE_OFF = "-event_engine_client,-event_engine_listener"
#: ``GRPC_EXPERIMENTS`` of the two sides of the ``core`` figure ("": gRPC's own defaults).
CORES = {"grpc_defaults": "", "event_engine_off": EVENT_ENGINE_OFF}


def _handlers() -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context: Any) -> bytes:
        return request

    async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )


async def _serve(port_out: list[int], ready: threading.Event) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(),))
    port_out.append(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    ready.set()
    await server.wait_for_termination()


async def _hog(duty_s: float, period_s: float) -> None:
    """Hold the loop ``duty_s`` of every ``period_s`` (CPU work between awaits)."""
    while True:
        end = time.perf_counter() + duty_s
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(period_s - duty_s)


def serve_main(mode: str) -> None:
    """The serving process: prints its port, serves until killed. ``mode``: uvloop, asyncio,
    busy (uvloop, the stream on the busy loop) or busy-thread (its own loop in a thread)."""
    port: list[int] = []

    async def main() -> None:
        ready = threading.Event()
        if mode == "busy-thread":
            threading.Thread(target=lambda: uvloop.run(_serve(port, ready)), daemon=True).start()
            await asyncio.to_thread(ready.wait)
            print(port[0], flush=True)
            await _hog(0.0005, 0.001)
            return
        task = asyncio.create_task(_serve(port, ready))
        await asyncio.to_thread(ready.wait)
        print(port[0], flush=True)
        if mode == "busy":
            await _hog(0.0005, 0.001)
        await task

    if mode == "asyncio":
        asyncio.run(main())
    else:
        uvloop.run(main())


class Client:
    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.unary = self.channel.unary_unary(f"/{SERVICE}/Unary")
        self.call = self.channel.stream_stream(f"/{SERVICE}/Stream")()

    async def echo_stream(self, payload: bytes, count: int = 1) -> float:
        started = time.perf_counter()
        for _ in range(count):
            await self.call.write(payload)
        for _ in range(count):
            await self.call.read()
        return time.perf_counter() - started

    async def echo_unary(self, payload: bytes) -> float:
        started = time.perf_counter()
        await self.unary(payload)
        return time.perf_counter() - started


async def measure(ports: dict[str, int], rounds: int, emit: Callable[[dict[str, Any]], None]) -> None:
    clients = {mode: Client(port) for mode, port in ports.items()}
    times: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for r in range(rounds + 20):  # the first 20 warm up
        keep = r >= 20
        uv, plain = clients["uvloop"], clients["asyncio"]
        for size in SIZES:
            t = await uv.echo_stream(bytes(size))
            if keep:
                add(f"stream_{size}", t)
        small = bytes(64)
        t_unary, t_loop = await uv.echo_unary(small), await plain.echo_stream(small)
        t_burst = await uv.echo_stream(small, BURST)
        t_one = await uv.echo_stream(bytes(64 * BURST))
        t_busy, t_thread = await clients["busy"].echo_stream(small), await clients["busy-thread"].echo_stream(small)
        if keep:
            for name, t in (("unary", t_unary), ("loop_asyncio", t_loop), ("burst_64", t_burst)):
                add(name, t)
            add("burst_as_one", t_one)
            add("busy_same_loop", t_busy)
            add("busy_own_thread", t_thread)
    med = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    emit({"figure": "per_message_us", **{k: round(v, 1) for k, v in med.items()}})
    emit(
        {
            "figure": "ratios",
            "stream_vs_unary": round(med["stream_64"] / med["unary"], 3),
            "asyncio_vs_uvloop": round(med["loop_asyncio"] / med["stream_64"], 3),
            "burst_per_message_vs_one": round(med["burst_64"] / BURST / med["stream_64"], 3),
            "burst_as_one_vs_burst": round(med["burst_as_one"] / med["burst_64"], 3),
            "busy_same_loop_vs_quiet": round(med["busy_same_loop"] / med["stream_64"], 3),
            "busy_own_thread_vs_quiet": round(med["busy_own_thread"] / med["stream_64"], 3),
            "size_64k_vs_64": round(med["stream_65536"] / med["stream_64"], 3),
        }
    )


def _spawn(args: list[str], experiments: str | None = None) -> subprocess.Popen[str]:
    env = None if experiments is None else {**os.environ, "GRPC_EXPERIMENTS": experiments}
    command = [sys.executable, "-m", "bench.grpc_cost", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)


def probe_main(port: int, count: int) -> None:
    """A client process: ``count`` stream echoes of 64 B to ``port``, their median in µs."""

    async def run() -> float:
        client = Client(port)
        times = [await client.echo_stream(bytes(64)) for _ in range(count + 20)][20:]
        return statistics.median(times) * 1e6

    print(json.dumps(uvloop.run(run())), flush=True)


def core_figure(blocks: int, count: int) -> dict[str, Any]:
    """The ``core`` figure: each setting's server and client processes, blocks alternated."""
    servers = {name: _spawn(["--serve", "uvloop"], value) for name, value in CORES.items()}
    try:
        ports = {name: int(p.stdout.readline()) for name, p in servers.items() if p.stdout is not None}
        medians: dict[str, list[float]] = {name: [] for name in CORES}
        for _ in range(blocks):
            for name, value in CORES.items():
                out, _ = _spawn(["--probe", str(ports[name]), "--count", str(count)], value).communicate()
                medians[name].append(json.loads(out))
    finally:
        for p in servers.values():
            p.kill()
            p.wait()
    us = {name: statistics.median(v) for name, v in medians.items()}
    return {
        "figure": "core",
        **{f"stream_64_us_{name}": round(v, 1) for name, v in us.items()},
        "event_engine_off_vs_grpc_defaults": round(us["event_engine_off"] / us["grpc_defaults"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=300, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_main(args.serve)
        return
    if args.probe:
        probe_main(args.probe, args.count)
        return
    servers = {
        mode: subprocess.Popen(
            [sys.executable, "-m", "bench.grpc_cost", "--serve", mode], stdout=subprocess.PIPE, text=True
        )
        for mode in ("uvloop", "asyncio", "busy", "busy-thread")
    }
    try:
        ports = {mode: int(p.stdout.readline()) for mode, p in servers.items() if p.stdout is not None}
        uvloop.run(measure(ports, args.rounds, lambda row: print(json.dumps(row), flush=True)))
    finally:
        for p in servers.values():
            p.kill()
            p.wait()
    print(json.dumps(core_figure(blocks=6, count=args.rounds)), flush=True)


if __name__ == "__main__":
    main()
