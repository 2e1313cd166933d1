"""Baseline: a plain UCXX tag send of one contiguous host buffer between two processes.

Same UCX settings as kvxferd (``apply_ucx_defaults``, endpoint from a worker address, error
handling as kvxferd's ``auto`` picks for a peer on this host, UCX progressed every loop
iteration as kvxferd does during a transfer). ``--memory shm`` (the default)
sends between POSIX shared-memory buffers, the memory kvxfer's host pools live in;
``--memory numpy`` between ordinary numpy arrays, which the kernel backs with huge pages and
copies faster on this machine; ``--memory cupy`` between two CuPy buffers on GPU 0 (the GPU
baseline). Prints one JSON line.

Run: ``python -m bench.ucx_baseline --bytes 268435456 --iters 10 --memory shm``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np


def _buffer(nbytes: int, memory: str) -> Any:
    if memory == "cupy":
        import cupy

        return cupy.zeros(nbytes, dtype=cupy.uint8)
    if memory == "numpy":
        return np.zeros(nbytes, dtype=np.uint8)
    from kvxfer_client import HostBuffer

    buf = HostBuffer.create(nbytes, prefix="kvxfer-baseline")
    buf.unlink()  # mapped already; nothing stays in /dev/shm
    arr = buf.array()
    arr.fill(0)
    return arr


def _tight_progress(ucxx: Any) -> Any:
    """Drive UCX progress the way kvxferd does during a transfer (every loop iteration)."""
    from kvxferd.dataplane.ucx import ProgressDriver, _take_over_progress

    driver = ProgressDriver(_take_over_progress(ucxx))
    driver.active += 1
    return driver


def _cuda_first(memory: str) -> None:
    """GPU buffers: create the CUDA context before UCX starts, as kvxferd does."""
    if memory == "cupy":
        import cupy

        cupy.cuda.runtime.free(0)


def _receiver(nbytes: int, iters: int, memory: str, addr_q: Any, ready_q: Any) -> None:
    from kvxferd.dataplane.ucx import apply_ucx_defaults

    _cuda_first(memory)
    apply_ucx_defaults()
    import ucxx

    async def run() -> None:
        addr_q.put(bytes(ucxx.get_worker_address()))
        driver = _tight_progress(ucxx)
        buf = _buffer(nbytes, memory)
        peer = ready_q.get()
        from ucxx._lib.libucxx import UCXAddress

        ep = await ucxx.create_endpoint_from_worker_address(
            UCXAddress.create_from_buffer(peer), endpoint_error_handling=False
        )
        for i in range(iters + 1):
            await ep.recv(buf, tag=1000 + i, force_tag=True)
        await ep.send(np.zeros(1, np.uint8), tag=999, force_tag=True)
        driver.stop()

    asyncio.run(run())


def _sender(nbytes: int, iters: int, memory: str, addr_q: Any, ready_q: Any, out_q: Any) -> None:
    from kvxferd.dataplane.ucx import apply_ucx_defaults

    _cuda_first(memory)
    apply_ucx_defaults()
    import ucxx
    from ucxx._lib.libucxx import UCXAddress

    async def run() -> None:
        peer = addr_q.get()
        ready_q.put(bytes(ucxx.get_worker_address()))
        driver = _tight_progress(ucxx)
        ep = await ucxx.create_endpoint_from_worker_address(
            UCXAddress.create_from_buffer(peer), endpoint_error_handling=False
        )
        buf = _buffer(nbytes, memory)
        data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        if memory == "cupy":
            buf.set(data)
        else:
            buf[:] = data
        times = []
        for i in range(iters + 1):  # the first send warms up registration and pages
            t0 = time.perf_counter()
            await ep.send(buf, tag=1000 + i, force_tag=True)
            if i:
                times.append(time.perf_counter() - t0)
        await ep.recv(np.zeros(1, np.uint8), tag=999, force_tag=True)
        driver.stop()
        out_q.put(times)

    asyncio.run(run())


def measure(nbytes: int, iters: int, memory: str = "shm") -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    addr_q, ready_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=_receiver, args=(nbytes, iters, memory, addr_q, ready_q))
    s = ctx.Process(target=_sender, args=(nbytes, iters, memory, addr_q, ready_q, out_q))
    r.start()
    s.start()
    times = out_q.get(timeout=300)
    s.join(60)
    r.join(60)
    # A send completes when the receiver has the bytes (rendezvous), so send time is transfer time.
    med = statistics.median(times)
    return {
        "memory": memory,
        "bytes": nbytes,
        "iters": iters,
        "gbps_median": nbytes / med / 1e9,
        "gbps_best": nbytes / min(times) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", type=int, default=256 << 20)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--memory", choices=["shm", "numpy", "cupy"], default="shm")
    args = parser.parse_args()
    print(json.dumps({"baseline": "ucxx-one-buffer", **measure(args.bytes, args.iters, args.memory)}))


if __name__ == "__main__":
    main()
