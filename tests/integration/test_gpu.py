"""GPU pools: CUDA IPC registration, the one-launch local path and the UCX GPU path.

Engines are separate processes holding CuPy tensors on GPU 0; the daemons map them through
CUDA IPC handles. Everything marked ``gpu`` skips on machines without a GPU; the last test
runs everywhere and pins down what a daemon without GPU support answers.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.cluster import Cluster, EngineProcess
from kvxfer.proto import common_pb2, engine_pb2
from kvxfer_client import AsyncKvxferClient, HostBuffer, InvalidRequestError, Layout

PATHS = ["local", "remote"]


def pair(
    cluster: Cluster,
    path: str,
    shape: dict[str, int],
    seed: int,
    tag: str,
    src: str = "gpu",
    dst: str = "gpu",
    offset: int = 0,
) -> tuple[EngineProcess, EngineProcess]:
    a, b = cluster.daemons[0], cluster.daemons[1]
    prefill = cluster.engine(a, f"prefill-{tag}-{path}")
    decode = cluster.engine(a if path == "local" else b, f"decode-{tag}-{path}")
    prefill("pool", shape=shape, seed=seed, memory=src, gpu_offset=offset)
    decode("pool", shape=shape, memory=dst, gpu_offset=offset)
    return prefill, decode


def handoffs(prefill: EngineProcess, decode: EngineProcess, blocks: int, per: int, count: int, seed: int) -> list:  # type: ignore[type-arg]
    rng = np.random.default_rng(seed)
    dst_all = rng.permutation(blocks)[: per * count]
    pairs = [(rng.permutation(blocks)[:per].tolist(), dst_all[i * per : (i + 1) * per].tolist()) for i in range(count)]
    tickets = prefill("offer", requests=[p[0] for p in pairs])["tickets"]
    results = decode("pull", pulls=[[t, p[1]] for t, p in zip(tickets, pairs, strict=True)])["results"]
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]][:1]
    released = prefill("released", offer_ids=[t["offer_id"] for t in tickets])
    assert released["reasons"] == ["pulled"] * count
    return [(pairs, results)]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_gpu_blocks_arrive_byte_exact_between_two_processes(two_daemons: Cluster, path: str) -> None:
    # 8 layers x K/V: a pool of 8 GPU tensors; 32 KiB blocks as in Llama-3-8B at block 16.
    shape = {"layers": 8, "blocks": 128, "block_bytes": 32 << 10}
    prefill, decode = pair(two_daemons, path, shape, seed=31, tag="exact")
    [(pairs, results)] = handoffs(prefill, decode, 128, per=40, count=3, seed=1)
    for r in results:
        assert r["bytes"] == 40 * 8 * 2 * (32 << 10)
        assert r["path"] == path
        assert r["transport"] == "local-kernel" if path == "local" else r["transport"].startswith("ucx:"), r
    assert decode("verify", seed=31, pairs=pairs)["verified"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_tensors_at_odd_offsets_with_misaligned_segments_arrive_exact(two_daemons: Cluster, path: str) -> None:
    # 1000 bytes into each allocation and 3000-byte segments: no address is 16-byte aligned.
    shape = {"layers": 3, "blocks": 64, "block_bytes": 3000}
    prefill, decode = pair(two_daemons, path, shape, seed=12, tag="odd", offset=1000)
    [(pairs, _)] = handoffs(prefill, decode, 64, per=20, count=3, seed=2)
    assert decode("verify", seed=12, pairs=pairs)["verified"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("src", "dst"), [("host", "gpu"), ("gpu", "host")])
def test_mixed_host_and_gpu_pools_arrive_exact(two_daemons: Cluster, path: str, src: str, dst: str) -> None:
    shape = {"layers": 2, "blocks": 64, "block_bytes": 16 << 10}
    prefill, decode = pair(two_daemons, path, shape, seed=5, tag=f"{src}2{dst}", src=src, dst=dst)
    [(pairs, _)] = handoffs(prefill, decode, 64, per=16, count=2, seed=3)
    assert decode("verify", seed=5, pairs=pairs)["verified"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_vllm_shaped_cuda_kv_tensors_get_their_layout_from_the_tensors_and_hand_off(
    two_daemons: Cluster, path: str
) -> None:
    """What the vLLM connector registers on a GPU: per-layer [2, num_blocks, 16, heads, 128]
    fp16 tensors, the layout read off them (the engine checks it equals the hand-written one),
    registered through CUDA IPC, handed off byte-exact."""
    a, b = two_daemons.daemons
    shape = {"layers": 4, "blocks": 96, "block_bytes": 16 * 8 * 128 * 2}  # 8 KV heads
    prefill = two_daemons.engine(a, f"prefill-vllmshape-{path}")
    decode = two_daemons.engine(a if path == "local" else b, f"decode-vllmshape-{path}")
    prefill("pool", shape=shape, seed=12, memory="gpu", vllm_shape=True)
    decode("pool", shape=shape, memory="gpu", vllm_shape=True)
    [(pairs, _)] = handoffs(prefill, decode, 96, per=24, count=2, seed=6)
    assert decode("verify", seed=12, pairs=pairs)["verified"]


@pytest.mark.gpu
def test_engine_owned_cpu_memory_meets_gpu_pools_remotely_and_is_refused_locally(two_daemons: Cluster) -> None:
    """GPU kernels reach only memory mapped into the daemon: a local handoff between a GPU pool
    and an engine's own numpy memory is refused before the offer is touched; between daemons
    each side moves its own memory, and it works."""
    shape = {"layers": 2, "blocks": 64, "block_bytes": 16 << 10}
    prefill, remote_decode = pair(two_daemons, "remote", shape, seed=6, tag="proc2gpu", src="numpy", dst="gpu")
    [(pairs, _)] = handoffs(prefill, remote_decode, 64, per=16, count=2, seed=3)
    assert remote_decode("verify", seed=6, pairs=pairs)["verified"]
    local_decode = two_daemons.engine(two_daemons.daemons[0], "decode-proc2gpu-local")
    local_decode("pool", shape=shape, memory="gpu")
    ticket = prefill("offer", requests=[[1, 2, 3]])["tickets"][0]
    refused = local_decode("pull", pulls=[[ticket, [4, 5, 6]]])["results"][0]
    assert not refused["ok"] and refused["type"] == "IncompatibleError", refused
    assert "HostBuffer" in refused["error"]
    assert remote_decode("pull", pulls=[[ticket, [4, 5, 6]]])["results"][0]["ok"]  # the offer survived


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_64_concurrent_gpu_handoffs_arrive_exact(two_daemons: Cluster, path: str) -> None:
    shape = {"layers": 4, "blocks": 1024, "block_bytes": 4096}
    prefill, decode = pair(two_daemons, path, shape, seed=8, tag="many")
    [(pairs, _)] = handoffs(prefill, decode, 1024, per=8, count=64, seed=4)
    assert decode("verify", seed=8, pairs=pairs)["verified"]


@pytest.mark.gpu
def test_a_gpu_pool_survives_a_large_multi_chunk_remote_handoff(two_daemons: Cluster) -> None:
    # 64 MiB in 2 MiB chunks: more chunks than the staging window, so staging is reused.
    shape = {"layers": 4, "blocks": 256, "block_bytes": 64 << 10}
    prefill, decode = pair(two_daemons, "remote", shape, seed=9, tag="big")
    [(pairs, _)] = handoffs(prefill, decode, 256, per=128, count=1, seed=5)
    assert decode("verify", seed=9, pairs=pairs)["verified"]


async def test_a_daemon_without_gpu_support_refuses_gpu_buffers_clearly(two_daemons: Cluster) -> None:
    """Runs everywhere: on a GPU machine the handle is garbage and must be refused just as
    clearly (and the daemon must survive it)."""
    layout = Layout.contiguous(num_blocks=4, block_bytes=4096)
    async with AsyncKvxferClient(two_daemons.daemons[0].socket, engine_name="bogus-gpu") as client:
        req = engine_pb2.RegisterPoolRequest(
            session_id=client.session_id,
            buffers=[
                common_pb2.BufferSpec(
                    kind=common_pb2.MEMORY_KIND_CUDA_IPC,
                    size=16384,
                    cuda_ipc_handle=bytes(64),
                    gpu_uuid="GPU-00000000-0000-0000-0000-000000000000",
                )
            ],
            layout=layout.to_proto(),
        )
        with pytest.raises(InvalidRequestError) as err:
            await client._call(client._engine.RegisterPool, req)
        assert any(
            s in str(err.value) for s in ("cannot map GPU memory", "not visible to this process", "CUDA IPC handle")
        ), str(err.value)
        # The daemon is fine afterwards: a host pool registers on the same session.
        pool = await client.register_pool([HostBuffer.create(16384)], layout)
        assert pool.pool_id
