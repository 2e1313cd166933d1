"""A stand-in serving engine, run as its own OS process, driven by JSON lines on stdin.

It uses only the public ``kvxfer_client`` API, exactly as a serving engine would. Each
command line gets one JSON reply line on stdout (``{"ok": true, ...}`` or ``{"ok": false,
"error": "...", "type": "..."}``). Commands:

* ``pool``: register a pool: ``{"op": "pool", "shape": {...}, "seed": 7}``; ``shape`` is
  ``{"layers": L, "blocks": N, "block_bytes": B}`` (vLLM-style per-layer K/V tensors) and a
  seed fills the pool with reproducible random bytes; ``"memory"`` is ``"host"`` (shared
  memory, the default), ``"numpy"`` (plain numpy arrays on this process's heap), ``"torch"``
  (torch CPU bfloat16 tensors, as vLLM on CPU allocates its KV caches) or ``"gpu"`` (a CuPy
  tensor per layer on GPU 0; ``"gpu_offset": 4096`` places each tensor that many bytes into
  its allocation, as torch's caching allocator does; ``"vllm_shape": true`` shapes each as
  vLLM's flash-attention KV tensor and derives the layout from it); ``"geometry": {...}``
  declares a ``KvGeometry`` (with ``"model"`` naming the TP rank) and ``"data"`` (base64, one
  string per buffer) gives the pool's bytes;
* ``offer``: ``{"op": "offer", "requests": [[ids...], ...], "lease_s": 30, "readers": 1}`` → tickets;
* ``pull``: ``{"op": "pull", "pulls": [[ticket, [ids...]], ...]}`` runs all pulls at once;
* ``verify``: ``{"op": "verify", "seed": 7, "pairs": [[[src ids], [dst ids]], ...]}`` checks
  every destination byte against the prefill pool regenerated from its seed;
* ``dump``: the pool's bytes, base64, one string per buffer;
* ``released``: ``{"op": "released", "offer_ids": [...], "timeout_s": 10}`` waits for events;
* ``echo``: ``{"op": "echo", "count": 20}``: that many gRPC health checks, one at a time, on
  the daemon's engine socket (a unary round trip through its event loop): their seconds;
  ``"in_flight": 64`` keeps that many going at once instead (and says the wall time);
* ``exit``.

Run: ``python -m bench.engine --socket /path/to/kvxferd.sock --name prefill``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvxfer_client import AsyncKvxferClient, HostBuffer, KvGeometry, KvxferError, Layout, ModelInfo, Pool

MODEL = ModelInfo(model="llama-3-8b-shape", dtype="bfloat16", block_tokens=16, tp_size=1, tp_rank=0)


def fill_random(buffers: list[npt.NDArray[np.uint8]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for buf in buffers:
        words = buf[: buf.nbytes // 8 * 8].view(np.uint64)
        words[:] = rng.integers(0, 2**64 - 1, size=words.size, dtype=np.uint64, endpoint=True)
        buf[words.nbytes :] = rng.integers(0, 256, size=buf.nbytes - words.nbytes, dtype=np.uint8)


def blocks_of(layout: Layout, buffers: list[HostBuffer], ids: list[int]) -> list[bytes]:
    """The bytes of blocks ``ids`` of a pool: every region's segment of each, in order."""
    arrays = [buf.array() for buf in buffers]
    return [
        arrays[r.buffer_index][r.offset + i * r.block_stride :][: r.block_bytes].tobytes()
        for r in layout.regions
        for i in ids
    ]


def _host_buffer(size: int, memory: str) -> Any:
    if memory == "host":
        return HostBuffer.create(size)
    if memory == "numpy":
        return np.zeros(size, dtype=np.uint8)
    if memory == "torch":
        import torch

        return torch.zeros(size // 2, dtype=torch.bfloat16)  # block_bytes are even here
    raise ValueError(f"unknown memory {memory!r}")


def _bytes_of(buf: Any, memory: str) -> npt.NDArray[np.uint8]:
    """A buffer's bytes as a uint8 numpy array: a view, except for GPU memory (a copy)."""
    if memory == "gpu":
        return buf.view("uint8").reshape(-1).get()  # type: ignore[no-any-return]
    if memory == "host":
        return buf.array()  # type: ignore[no-any-return]
    if memory == "torch":
        import torch

        return buf.view(torch.uint8).numpy()  # type: ignore[no-any-return]
    return buf  # type: ignore[no-any-return]


def kv_view(buf: npt.NDArray[np.uint8], blocks: int, block_bytes: int) -> npt.NDArray[np.uint8]:
    """A per-layer buffer as [K/V, block, bytes]."""
    return buf.reshape(2, blocks, block_bytes)


class Engine:
    def __init__(self, client: AsyncKvxferClient) -> None:
        self.client = client
        self.pool: Pool | None = None
        self.shape: dict[str, int] = {}
        self.memory = "host"
        self._echo: Any = None
        #: Offers made under tickets already handed out (``offer`` with ``early``).
        self._early: set[asyncio.Task[Any]] = set()

    def arrays(self) -> list[npt.NDArray[np.uint8]]:
        """The pool's buffers as host byte arrays (a copy from the GPU for GPU pools)."""
        assert self.pool is not None
        return [_bytes_of(b, self.memory) for b in self.pool.buffers]

    async def op_pool(
        self,
        shape: dict[str, int],
        seed: int | None = None,
        model: dict[str, Any] | None = None,
        memory: str = "host",
        gpu_offset: int = 0,
        vllm_shape: bool = False,
        geometry: dict[str, Any] | None = None,
        data: list[str] | None = None,
    ) -> Any:
        layout = Layout.paged_kv(
            num_layers=shape["layers"],
            num_blocks=shape["blocks"],
            block_bytes=shape["block_bytes"],
            model=ModelInfo(**model) if model else MODEL,
            geometry=KvGeometry(**geometry) if geometry else None,
        )
        self.shape = shape
        self.memory = memory
        buffers: list[Any]
        if memory == "gpu":
            import cupy

            # Each layer's tensor sits ``gpu_offset`` bytes into its own allocation.
            buffers = [cupy.zeros(size + gpu_offset, dtype=cupy.uint8)[gpu_offset:] for size in layout.buffer_sizes()]
            if vllm_shape:
                # vLLM's flash-attention KV tensor: [2, num_blocks, block_size, kv_heads, head_dim]
                # fp16, its layout read off the tensor by the connector's own code.
                from kvxfer_client import layout_from_tensors
                from kvxfer_client.vllm._tensors import block_dim_of

                heads, head_dim = shape["block_bytes"] // (16 * 128 * 2), 128
                dims = (2, shape["blocks"], 16, heads, head_dim)
                buffers = [b.view(cupy.float16).reshape(dims) for b in buffers]
                derived = layout_from_tensors(buffers, block_dim=block_dim_of(buffers[0], shape["blocks"]), model=MODEL)
                if derived.regions != layout.regions or derived.num_blocks != layout.num_blocks:
                    raise ValueError(f"derived layout {derived.regions[:2]} differs from {layout.regions[:2]}")
                layout = derived
            if seed is not None:
                host = [np.empty(size, dtype=np.uint8) for size in layout.buffer_sizes()]
                fill_random(host, seed)
                for dev, h in zip(buffers, host, strict=True):
                    dev.view(cupy.uint8).reshape(-1).set(h)
            cupy.cuda.Device().synchronize()  # written before anything is offered
        else:
            buffers = [_host_buffer(size, memory) for size in layout.buffer_sizes()]
            if seed is not None:
                fill_random([_bytes_of(b, memory) for b in buffers], seed)
            for b, text in zip(buffers, data or [], strict=False):
                _bytes_of(b, memory)[:] = np.frombuffer(base64.b64decode(text), dtype=np.uint8)
        self.pool = await self.client.register_pool(buffers, layout, name=self.client.engine_name)
        return {"pool_id": self.pool.pool_id, "fingerprint": self.pool.fingerprint}

    async def op_offer(
        self, requests: list[list[int]], lease_s: float = 0.0, readers: int = 1, early: bool = False
    ) -> Any:
        """Offer each request's blocks; ``early``: as vLLM's connector does, hand each ticket
        out at once (``new_ticket``) and make its offer under it without waiting for the
        answer (a failed one fails the next ``offer`` op, and its pull)."""
        assert self.pool is not None
        pool = self.pool
        for made in [t for t in self._early if t.done()]:
            self._early.discard(made)
            made.result()
        t0 = time.perf_counter()
        if early:
            tickets = [self.client.new_ticket(pool, len(ids), readers) for ids in requests]
            for ids, ticket in zip(requests, tickets, strict=True):
                self._early.add(asyncio.create_task(self.client.offer(pool, ids, lease_s=lease_s, ticket=ticket)))
            return {"tickets": [t.to_dict() for t in tickets], "offer_s": time.perf_counter() - t0}
        offers = [self.client.offer(pool, ids, lease_s=lease_s, readers=readers) for ids in requests]
        # One offer is awaited as an engine awaits it (gather would add a task's turn of the loop).
        tickets = [await offers[0]] if len(offers) == 1 else await asyncio.gather(*offers)
        return {"tickets": [t.to_dict() for t in tickets], "offer_s": time.perf_counter() - t0}

    async def op_pull(self, pulls: list[tuple[dict[str, Any], list[int]]], timeout_s: float = 60.0) -> Any:
        assert self.pool is not None
        pool = self.pool

        async def one(ticket: dict[str, Any], ids: list[int]) -> dict[str, Any]:
            t0 = time.perf_counter()
            try:
                r = await self.client.pull(ticket, pool, ids, timeout_s=timeout_s)
            except KvxferError as exc:
                return {"ok": False, "error": str(exc), "type": type(exc).__name__}
            return {
                "ok": True,
                "transfer_id": r.transfer_id,
                "bytes": r.bytes,
                "path": r.path,
                "transport": r.transport,
                "daemon_s": r.duration_s,
                "data_plane_s": r.data_plane_s,
                "device_s": r.device_s,
                "mapping": r.mapping,
                "latency_s": time.perf_counter() - t0,
            }

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(t, ids) for t, ids in pulls))
        return {"results": results, "wall_s": time.perf_counter() - t0}

    async def op_verify(self, seed: int, pairs: list[tuple[list[int], list[int]]]) -> Any:
        s = self.shape
        actual = self.arrays()
        expected = [np.empty(b.nbytes, dtype=np.uint8) for b in actual]
        fill_random(expected, seed)
        bad = 0
        for src_ids, dst_ids in pairs:
            for exp, got in zip(expected, actual, strict=True):
                e = kv_view(exp, s["blocks"], s["block_bytes"])[:, src_ids]
                g = kv_view(got, s["blocks"], s["block_bytes"])[:, dst_ids]
                bad += int(np.count_nonzero(e != g))
        return {"verified": bad == 0, "bad_bytes": bad}

    async def op_dump(self) -> Any:
        """The pool's bytes, one base64 string per buffer (small pools: the tests' reference check)."""
        return {"buffers": [base64.b64encode(a.tobytes()).decode() for a in self.arrays()]}

    async def op_withdraw(self, offer_id: str) -> Any:
        await self.client.release(offer_id)
        return {}

    async def op_echo(self, count: int, in_flight: int = 1) -> Any:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if self._echo is None:
            channel = grpc.aio.insecure_channel(f"unix:{self.client.socket_path}")
            self._echo = health_pb2_grpc.HealthStub(channel)
        times: list[float] = []
        slots = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with slots:
                t0 = time.perf_counter()
                await self._echo.Check(health_pb2.HealthCheckRequest(), timeout=10)
                times.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        if in_flight == 1:
            for _ in range(count):
                await one()
        else:
            await asyncio.gather(*(one() for _ in range(count)))
        return {"seconds": times, "wall_s": time.perf_counter() - t0}

    async def op_released(self, offer_ids: list[str], timeout_s: float = 10.0) -> Any:
        events = await asyncio.gather(*(self.client.wait_released(o, timeout_s) for o in offer_ids))
        return {
            "reasons": [e.reason.value for e in events],
            "transfer_ids": [e.transfer_id for e in events],
            "details": [e.detail for e in events],
        }


async def main_async(args: argparse.Namespace) -> None:
    client = AsyncKvxferClient(args.socket, engine_name=args.name)
    await client.connect()
    engine = Engine(client)
    loop = asyncio.get_running_loop()
    print(json.dumps({"ok": True, "ready": True, "session_id": client.session_id}), flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            reply = {"ok": True, **(await getattr(engine, "op_" + op)(**cmd))}
        except KvxferError as exc:
            reply = {"ok": False, "error": str(exc), "type": type(exc).__name__}
        print(json.dumps(reply), flush=True)
    await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--name", default="engine")
    parser.add_argument(
        "--loop",
        choices=["asyncio", "uvloop"],
        default=os.environ.get("KVXFER_BENCH_LOOP", "asyncio"),
        help="the engine's event loop (default: $KVXFER_BENCH_LOOP, else asyncio)",
    )
    args = parser.parse_args()
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main_async(args))
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
