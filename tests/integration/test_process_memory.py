"""Engines registering their own CPU memory as it is (numpy arrays, torch CPU tensors): real
daemons, engines in their own processes, local and remote handoffs, and what is refused.

The engine's process attaches itself on the fd socket; the daemon takes its pid from the
socket's peer credentials and moves bytes with process_vm_readv/writev."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from bench.cluster import ROOT, Cluster
from bench.engine import MODEL
from kvxfer.proto import common_pb2, engine_pb2
from kvxfer_client import (
    AsyncKvxferClient,
    HostBuffer,
    InvalidRequestError,
    KvxferClient,
    KvxferError,
    Layout,
)

SHAPE = {"layers": 3, "blocks": 48, "block_bytes": 5000}


@pytest.fixture(scope="module")
def daemons() -> Iterator[Cluster]:
    # 64 KiB chunks and a window of 3: a remote handoff here is 14 chunks through staging.
    with Cluster() as c:
        c.daemon("a", "--chunk-bytes", "65536", "--window", "3")
        c.daemon("b", "--chunk-bytes", "65536", "--window", "3")
        yield c


CASES = [
    ("numpy", "numpy", "local"),  # one engine's process to another's: through scratch
    ("torch", "host", "local"),  # process_vm_readv straight into shared memory
    ("host", "torch", "local"),  # process_vm_writev straight from shared memory
    ("numpy", "torch", "remote"),  # staged on both daemons
    ("torch", "numpy", "remote"),
    ("host", "numpy", "remote"),
]


@pytest.mark.parametrize(("src", "dst", "path"), CASES)
def test_numpy_and_torch_memory_hands_off_byte_exact(daemons: Cluster, src: str, dst: str, path: str) -> None:
    a, b = daemons.daemons
    prefill = daemons.engine(a, f"p-{src}-{dst}-{path}")
    decode = daemons.engine(a if path == "local" else b, f"d-{src}-{dst}-{path}")
    prefill("pool", shape=SHAPE, seed=4, memory=src)
    decode("pool", shape=SHAPE, memory=dst)
    rng = np.random.default_rng(1)
    dst_all = rng.permutation(48)[:40]  # the second pull must not overwrite the first
    pairs = [(rng.permutation(48)[:20].tolist(), dst_all[i * 20 : i * 20 + 20].tolist()) for i in range(2)]
    tickets = prefill("offer", requests=[p[0] for p in pairs])["tickets"]
    for ticket, (_, ids) in zip(tickets, pairs, strict=True):
        result = decode("pull", pulls=[[ticket, ids]])["results"][0]
        assert result["ok"], result
        assert result["bytes"] == 20 * 3 * 2 * 5000
        assert result["transport"] == ("local-copy" if path == "local" else "ucx:shm+cma")
    assert decode("verify", seed=4, pairs=pairs) == {"ok": True, "verified": True, "bad_bytes": 0}
    assert prefill("released", offer_ids=[t["offer_id"] for t in tickets])["reasons"] == ["pulled"] * 2


def test_the_pool_is_listed_as_process_memory(daemons: Cluster) -> None:
    engine = daemons.engine(daemons.daemons[0], "listed")
    pool_id = engine("pool", shape=SHAPE, memory="numpy")["pool_id"]
    pools = {p["pool"]: p for p in json.loads(_ctl(daemons.daemons[0].socket, "pools", "--json").stdout)}
    assert pools[pool_id]["memory"] == "process", pools[pool_id]


# -- refusals: the test process is the engine ---------------------------------------------------


async def _raw_register(client: AsyncKvxferClient, address: int, size: int) -> None:
    """RegisterPool with one HOST_PROCESS buffer at ``address``, as a hostile engine would send it."""
    layout = Layout.paged_kv(num_layers=1, num_blocks=1, block_bytes=size // 2)
    spec = common_pb2.BufferSpec(kind=common_pb2.MEMORY_KIND_HOST_PROCESS, size=size, process_address=address)
    req = engine_pb2.RegisterPoolRequest(session_id=client.session_id, buffers=[spec], layout=layout.to_proto())
    await client._call(client._engine.RegisterPool, req)


async def test_memory_the_engine_does_not_have_is_refused_and_the_daemon_lives(daemons: Cluster) -> None:
    sock = daemons.daemons[0].socket
    one_block = Layout.paged_kv(num_layers=1, num_blocks=1, block_bytes=4096)
    async with AsyncKvxferClient(sock, engine_name="hostile") as client:
        with pytest.raises(InvalidRequestError, match="attached to this session first"):
            await _raw_register(client, 1 << 20, 8192)  # not attached yet
        await client.register_pool([np.zeros(8192, dtype=np.uint8)], one_block)  # attaches
        with pytest.raises(InvalidRequestError, match="is not mapped in engine process"):
            await _raw_register(client, 0x1000, 8192)  # the lowest pages: never mapped
        with mmap.mmap(-1, 8192, prot=mmap.PROT_READ) as ro:
            address = np.frombuffer(ro, dtype=np.uint8).ctypes.data
            with pytest.raises(InvalidRequestError, match="mapped 'r--"):
                await _raw_register(client, address, 8192)
        with pytest.raises(InvalidRequestError, match="read-only"):
            await client.register_pool([np.frombuffer(bytes(8192), dtype=np.uint8)], one_block)
        with pytest.raises(InvalidRequestError, match="contiguous"):
            await client.register_pool([np.zeros(16384, dtype=np.uint8)[::2]], one_block)
        with pytest.raises(InvalidRequestError, match="not a buffer kvxfer can register"):
            await client.register_pool([bytearray(8192)], one_block)
    async with AsyncKvxferClient(sock, engine_name="after") as client:  # still serving
        await client.register_pool([np.zeros(8192, dtype=np.uint8)], one_block)


def test_a_session_stays_with_the_process_that_attached_it(daemons: Cluster) -> None:
    """Another process that learned the session id cannot attach itself in its place."""
    sock = daemons.daemons[0].socket
    with KvxferClient(sock, engine_name="owner") as client:
        client.register_pool(
            [np.zeros(8192, dtype=np.uint8)], Layout.paged_kv(num_layers=1, num_blocks=1, block_bytes=4096)
        )
        intruder = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from kvxfer_client._fds import attach_process; "
                "attach_process(sys.argv[1], sys.argv[2], 5.0)",
                sock + ".fds",
                client.session_id,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
        )
        assert intruder.returncode != 0
        assert f"attached to engine process {os.getpid()}" in intruder.stderr, intruder.stderr[-500:]


def test_attach_takes_the_pid_from_the_kernel_not_from_the_message(daemons: Cluster) -> None:
    """A message that names another pid changes nothing: the daemon reads the connection's
    peer credentials."""
    sock = daemons.daemons[0].socket

    async def go() -> None:
        client = AsyncKvxferClient(sock, engine_name="claims")
        await client.connect()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(sock + ".fds")
                s.send(json.dumps({"session_id": client.session_id, "attach": "process", "pid": 1}).encode())
                reply = json.loads(s.recv(4096))
            assert reply["attached"]["pid"] == os.getpid(), reply
        finally:
            await client.close()

    asyncio.run(go())


async def test_an_engine_that_exits_mid_transfer_ends_its_registration_there(cluster: Cluster) -> None:
    """The prefill engine dies while its process memory is being sent: the session ends, the
    next chunk is not read from a process that is gone (nor from whatever reuses its pid), the
    pull fails with a typed error, and the daemon drops the pool and keeps serving."""
    a = cluster.daemon("a", "--chunk-bytes", "65536", "--fault-injection", "--faults", "after_chunk_sent:0=pause:3")
    b = cluster.daemon("b", "--chunk-bytes", "65536")
    prefill = cluster.engine(a, "dies")
    pool_id = prefill("pool", shape=SHAPE, seed=2, memory="numpy")["pool_id"]
    ticket = prefill("offer", requests=[list(range(40))], lease_s=60)["tickets"][0]
    layout = Layout.paged_kv(num_layers=3, num_blocks=48, block_bytes=5000, model=MODEL)
    async with AsyncKvxferClient(b.socket, engine_name="d") as decode:
        dst = await decode.register_pool([HostBuffer.create(s) for s in layout.buffer_sizes()], layout)
        pull = asyncio.create_task(decode.pull(ticket, dst, list(range(40)), timeout_s=30))
        started = time.monotonic()
        while "fault.hit" not in a.log():  # chunk 0 is sent; the rest wait behind the pause
            assert time.monotonic() - started < 20 and not pull.done(), a.log()[-3000:]
            await asyncio.sleep(0.02)
        prefill.kill()
        with pytest.raises(KvxferError) as failure:
            await pull
    # Whichever the daemon sees first: the session's end (which deregisters the pool and aborts
    # its transfers) or the next chunk's read finding the process gone.
    why = str(failure.value)
    assert any(w in why for w in ("was deregistered", "exited", "session of pid")), failure.value
    assert "Traceback" not in a.log()
    pools = json.loads(_ctl(a.socket, "--json", "pools").stdout)
    assert pool_id not in {p["pool"] for p in pools}
    assert _ctl(a.socket, "health").stdout.strip() == "serving"


def _ctl(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvxfer_client._ctl", "--socket", sock, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30, check=True)


async def test_hostile_fd_socket_messages_get_errors_and_the_daemon_lives(daemons: Cluster) -> None:
    path = daemons.daemons[0].socket + ".fds"
    async with AsyncKvxferClient(daemons.daemons[0].socket, engine_name="target") as client:
        sid = client.session_id
        with open(os.devnull, "rb") as devnull:
            cases: list[tuple[bytes, list[int], str]] = [
                (b"not json", [], "one JSON object per message"),
                (b"[1, 2]", [], "expected"),
                (json.dumps({"session_id": 5}).encode(), [], "expected"),
                (json.dumps({"session_id": "sess-nope", "attach": "process"}).encode(), [], "no such session"),
                (json.dumps({"session_id": sid, "attach": "everything"}).encode(), [], "attach"),
                (json.dumps({"session_id": sid, "attach": "process"}).encode(), [devnull.fileno()], "nothing attached"),
                (json.dumps({"session_id": sid}).encode(), [], "no descriptors attached"),
                (json.dumps({"session_id": sid, "pad": "x" * 8000}).encode(), [], "at most 4096 bytes"),
            ]
            for message, fds, why in cases:
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.settimeout(5)
                    s.connect(path)
                    if fds:
                        socket.send_fds(s, [message], fds)
                    else:
                        s.send(message)
                    reply = json.loads(s.recv(65536))
                assert why in reply.get("error", ""), (message[:60], reply)
        # Still serving, and the session can attach itself as usual.
        await client.register_pool(
            [np.zeros(8192, dtype=np.uint8)], Layout.paged_kv(num_layers=1, num_blocks=1, block_bytes=4096)
        )
