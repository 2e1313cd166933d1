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
import hashlib
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
    arr = buf.array()
    arr.fill(0)
    return arr


def _cuda_first(memory: str) -> None:
    """GPU buffers: create the CUDA context before UCX starts, as kvxferd does."""
    if memory == "cupy":
        import cupy

        cupy.cuda.runtime.free(0)


def _say(conn: Any, message: object) -> None:
    """Commands and answers cross the pipes as JSON, never pickle."""
    conn.send_bytes(json.dumps(message).encode())


def _hear(conn: Any) -> Any:
    return json.loads(conn.recv_bytes())


def _swap_addresses(ucxx: Any, conn: Any, first: bool) -> bytes:
    """Exchange worker addresses over ``conn`` (the receiver speaks first); returns the peer's."""
    own = bytes(ucxx.get_worker_address())
    if first:
        conn.send_bytes(own)
        return conn.recv_bytes()
    peer = conn.recv_bytes()
    conn.send_bytes(own)
    return peer


def _serve(role: str, nbytes: int, memory: str, peer_conn: Any, cmd: Any) -> None:
    """One side of the pair: waits for a command on ``cmd``, moves one buffer, answers.

    Between commands UCX is progressed at kvxferd's idle pace, so a pair kept alive next to
    the daemons takes no CPU from them; during a send or receive it is progressed tightly.
    """
    from kvxferd.dataplane.ucx_setup import ProgressDriver, apply_ucx_defaults, take_over_progress

    _cuda_first(memory)
    apply_ucx_defaults()
    import ucxx
    from ucxx._lib.libucxx import UCXAddress

    async def run() -> None:
        loop = asyncio.get_running_loop()
        driver = ProgressDriver(take_over_progress(ucxx))
        peer = _swap_addresses(ucxx, peer_conn, first=role == "receiver")
        ep = await ucxx.create_endpoint_from_worker_address(
            UCXAddress.create_from_buffer(peer), endpoint_error_handling=False
        )
        buf = _buffer(nbytes, memory)
        if role == "sender":
            data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            if memory == "cupy":
                buf.set(data)
            else:
                buf[:] = data
        _say(cmd, "ready")
        while True:
            tag = await loop.run_in_executor(None, _hear, cmd)
            if tag is None:
                break
            if tag == "digest":
                host = buf.get() if memory == "cupy" else buf
                _say(cmd, hashlib.blake2b(memoryview(host), digest_size=16).hexdigest())
                continue
            with driver.busy():
                if role == "receiver":
                    receiving = asyncio.ensure_future(ep.recv(buf, tag=tag, force_tag=True))
                    await asyncio.sleep(0)  # posted before the sender is told to go
                    _say(cmd, "posted")
                    await receiving
                    _say(cmd, "received")
                else:
                    t0 = time.perf_counter()
                    # A send completes when the receiver has the bytes (rendezvous), so the
                    # send's time is the transfer's time.
                    await ep.send(buf, tag=tag, force_tag=True)
                    _say(cmd, time.perf_counter() - t0)
        driver.stop()

    asyncio.run(run())


class BaselinePair:
    """A sender and a receiver process kept alive, moving one buffer per :meth:`send`.

    Keeping the pair alive lets a benchmark interleave baseline sends with the transfers it
    compares them to, one by one, so both see the same machine state.

    >>> with BaselinePair(1 << 20, "numpy") as pair:  # doctest: +SKIP
    ...     seconds = pair.send()
    """

    TIMEOUT_S = 120.0

    def __init__(self, nbytes: int, memory: str = "shm") -> None:
        if memory not in ("shm", "numpy", "cupy"):
            raise ValueError(f"memory must be shm, numpy or cupy, not {memory!r}")
        self.nbytes = nbytes
        self.memory = memory
        self._tag = 1000
        ctx = mp.get_context("spawn")
        peer_r, peer_s = ctx.Pipe()
        self._cmd: dict[str, Any] = {}
        self._procs = []
        for role, peer in (("receiver", peer_r), ("sender", peer_s)):
            ours, theirs = ctx.Pipe()
            self._cmd[role] = ours
            self._procs.append(ctx.Process(target=_serve, args=(role, nbytes, memory, peer, theirs), daemon=True))
        for proc in self._procs:
            proc.start()
        try:
            for role in ("receiver", "sender"):
                self._expect(role, "ready")
            self.send()  # the first send warms up registration and pages
        except BaseException:
            self.close()
            raise

    def _answer(self, role: str) -> Any:
        conn = self._cmd[role]
        if not conn.poll(self.TIMEOUT_S):
            raise TimeoutError(f"baseline {role} gave no answer in {self.TIMEOUT_S}s")
        return _hear(conn)

    def _expect(self, role: str, word: str) -> None:
        got = self._answer(role)
        if got != word:
            raise RuntimeError(f"baseline {role} said {got!r}, expected {word!r}")

    def send(self) -> float:
        """Move the buffer once; returns the seconds the send took."""
        self._tag += 1
        _say(self._cmd["receiver"], self._tag)
        self._expect("receiver", "posted")
        _say(self._cmd["sender"], self._tag)
        seconds = float(self._answer("sender"))
        self._expect("receiver", "received")
        return seconds

    def digests(self) -> tuple[str, str]:
        """Digests of the sender's and the receiver's buffer (equal once a send went through)."""
        for conn in self._cmd.values():
            _say(conn, "digest")
        return str(self._answer("sender")), str(self._answer("receiver"))

    def close(self) -> None:
        for conn in self._cmd.values():
            try:
                _say(conn, None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> BaselinePair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure(nbytes: int, iters: int, memory: str = "shm") -> dict[str, Any]:
    with BaselinePair(nbytes, memory) as pair:
        times = [pair.send() for _ in range(iters)]
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
