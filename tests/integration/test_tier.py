"""The node's KV tier (kvxferd/tier/) with a real daemon and engines: store, lookup and load
byte-exact; prefixes; tensor-parallel ranks filling one chunk that an engine of another TP
and head order loads; eviction under 10x oversubscription within the memory limit; stores
and loads of the same keys at once; a killed engine's blocks still served; a restarted daemon
starting clean; hostile calls refused typed."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import pytest

from bench.cluster import ROOT, Cluster, Daemon
from bench.heads import HEAD_BYTES, LAYERS, POOL_BLOCKS, logical_kv
from bench.heads import Pool as HeadsPool
from kvxfer.geometry import rank_heads
from kvxfer.proto import admin_pb2, admin_pb2_grpc, common_pb2, peer_pb2, peer_pb2_grpc
from kvxfer_client import (
    AsyncKvxferClient,
    HostBuffer,
    InvalidRequestError,
    KvGeometry,
    Layout,
    ModelInfo,
    NotFoundError,
    PermissionDeniedError,
    Pool,
    UnavailableError,
)

LAYOUT = Layout.paged_kv(num_layers=4, num_blocks=64, block_bytes=16 << 10, model=ModelInfo("m", "bf16", 16))
BLOCK = LAYOUT.bytes_per_block  # 128 KiB


def keys(n: int, seed: bytes = b"conversation") -> list[bytes]:
    """Chained keys: each names its block's tokens and every block before it."""
    out, prev = [], seed
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


def filled(layout: Layout, seed: int) -> list[HostBuffer]:
    buffers = [HostBuffer.create(s) for s in layout.buffer_sizes()]
    for i, buf in enumerate(buffers):
        buf.array()[:] = np.random.default_rng(seed * 100 + i).integers(0, 256, buf.size, dtype=np.uint8)
    return buffers


def blocks(layout: Layout, buffers: list[HostBuffer], ids: list[int]) -> list[bytes]:
    out = []
    for r in layout.regions:
        arr = buffers[r.buffer_index].array()
        out += [bytes(arr[r.offset + b * r.block_stride :][: r.block_bytes]) for b in ids]
    return out


def tier_of(daemon: Daemon) -> admin_pb2.ListTierResponse:
    return daemon.admin("ListTier", admin_pb2.ListTierRequest())


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        line = next(line for line in fh if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


async def test_blocks_stored_by_one_engine_load_byte_exact_into_another(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--tier-host-bytes", str(64 << 20))
    async with (
        AsyncKvxferClient(a.socket, engine_name="first") as e1,
        AsyncKvxferClient(a.socket, engine_name="second") as e2,
    ):
        src_bufs = filled(LAYOUT, 1)
        src = await e1.register_pool(src_bufs, LAYOUT)
        k = keys(6)
        assert await e1.tier_store(src, [3, 7, 9, 11], k[:4]) == (4, 0)
        assert await e1.tier_store(src, [3, 7, 9, 11, 12], k[:5]) == (1, 4)  # four were there
        assert await e2.tier_lookup(await e2.register_pool(filled(LAYOUT, 9), LAYOUT), k) == 5
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        dst = await e2.register_pool(dst_bufs, LAYOUT)
        assert await e2.tier_lookup(dst, [k[0], k[1], b"another prompt", k[3]]) == 2  # a prefix
        assert await e2.tier_lookup(dst, k[:3], salt=b"tenant-b") == 0  # another namespace
        assert await e2.tier_load(dst, [0, 1, 2, 3, 4, 5], k) == 5  # the sixth is computed
        assert blocks(LAYOUT, dst_bufs, [0, 1, 2, 3, 4]) == blocks(LAYOUT, src_bufs, [3, 7, 9, 11, 12])
        other = Layout.paged_kv(num_layers=4, num_blocks=64, block_bytes=16 << 10, model=ModelInfo("other", "bf16", 16))
        assert await e2.tier_lookup(await e2.register_pool(filled(other, 2), other), k) == 0  # another model
        t = tier_of(a)
        assert (t.limit_bytes, t.used_bytes) == (64 << 20, 5 * BLOCK)
        [ns] = [n for n in t.namespaces if n.chunks]
        assert (ns.chunks, ns.label) == (5, "m bf16 x16")
        assert ns.hits >= 5 + 2 + 5 and ns.misses >= 1


def _rank_pool_layout(heads: int, tp: int, rank: int, order: str, block_tokens: int) -> Layout:
    share = rank_heads(heads, tp, rank).count
    model = ModelInfo("tp-model", "bf16", block_tokens, tp_size=tp, tp_rank=rank)
    return Layout.paged_kv(
        num_layers=LAYERS,
        num_blocks=POOL_BLOCKS,
        block_bytes=block_tokens * share * HEAD_BYTES,
        model=model,
        geometry=KvGeometry(block_tokens, heads, HEAD_BYTES, order),  # type: ignore[arg-type]
    )


async def test_tensor_parallel_ranks_fill_one_chunk_that_another_tp_and_head_order_loads(cluster: Cluster) -> None:
    """Two TP-2 ranks (heads-major) store their heads under the same keys; the chunks appear
    only once both did; a TP-1 tokens-major engine loads them and holds the model's KV."""
    a = cluster.daemon("a", "--tier-host-bytes", str(64 << 20))
    heads, tokens, block_tokens = 8, 64, 16
    logical = logical_kv(heads, tokens, seed=5)
    ids = [5, 1, 20, 9]
    k = keys(tokens // block_tokens, seed=b"tp")
    async with AsyncKvxferClient(a.socket, engine_name="prefill-tp2") as e:
        rank_pools = []
        for rank in range(2):
            ref = HeadsPool.empty(rank_heads(heads, 2, rank), block_tokens, "HND")
            ref.fill(logical, ids)
            layout = _rank_pool_layout(heads, 2, rank, "HND", block_tokens)
            bufs = [HostBuffer.create(s) for s in layout.buffer_sizes()]
            for buf, arr in zip(bufs, ref.buffers, strict=True):
                buf.array()[:] = arr
            rank_pools.append(await e.register_pool(bufs, layout))
        assert await e.tier_store(rank_pools[0], ids, k) == (4, 0)
        assert await e.tier_lookup(rank_pools[0], k) == 0  # rank 1's heads are not in yet
        assert await e.tier_store(rank_pools[1], ids, k) == (4, 0)
        assert await e.tier_lookup(rank_pools[1], k) == 4
    async with AsyncKvxferClient(a.socket, engine_name="decode-tp1") as d:
        layout = _rank_pool_layout(heads, 1, 0, "NHD", block_tokens)
        bufs = [HostBuffer.create(s) for s in layout.buffer_sizes()]
        pool = await d.register_pool(bufs, layout)
        dst_ids = [0, 2, 4, 6]
        assert await d.tier_load(pool, dst_ids, k) == 4
        ref = HeadsPool.empty(rank_heads(heads, 1, 0), block_tokens, "NHD")
        expected = ref.expected(logical, dst_ids, ref.heads, tokens)
        for buf, want in zip(bufs, expected, strict=True):
            np.testing.assert_array_equal(buf.array(), want)


async def test_ten_times_more_than_fits_evicts_oldest_first_and_stays_within_memory(cluster: Cluster) -> None:
    """A 32 MiB tier takes 320 MiB of stores: it never holds more than its limit, the latest
    conversation stays, the oldest is gone; a second namespace then takes the memory over and
    the daemon's resident memory stays where the full tier had it (evicted pages go back;
    without that it would grow by the limit)."""
    limit = 32 << 20
    a = cluster.daemon("a", "--tier-host-bytes", str(limit), "--tier-low-watermark", "0.75")
    assert a.proc is not None
    async with AsyncKvxferClient(a.socket, engine_name="engine") as e:
        pool = await e.register_pool(filled(LAYOUT, 3), LAYOUT)
        stored, rss_full = 0, 0
        for turn in range(80):  # 80 conversations of 32 blocks (4 MiB): 10x the tier
            k = keys(32, seed=f"turn-{turn}".encode())
            done, _ = await e.tier_store(pool, list(range(32)), k)
            stored += done
            assert tier_of(a).used_bytes <= limit
            if turn == 8:  # the tier is full (and the copy threads' scratch made)
                rss_full = rss_bytes(a.proc.pid)
        assert stored == 80 * 32  # evictions made room every time
        assert await e.tier_lookup(pool, keys(32, seed=b"turn-79")) == 32
        assert await e.tier_lookup(pool, keys(32, seed=b"turn-0")) == 0
        assert tier_of(a).namespaces[0].evictions > 0
        for turn in range(12):  # another namespace (salt) evicts everything of the first
            await e.tier_store(pool, list(range(32)), keys(32, seed=f"b-{turn}".encode()), salt=b"b")
        t = tier_of(a)
        assert t.used_bytes <= limit and sum(n.chunks for n in t.namespaces) * BLOCK == t.used_bytes
        grown = rss_bytes(a.proc.pid) - rss_full  # a second namespace's slots, less the first's given back
        assert grown < limit / 2, f"resident memory grew by {grown >> 20} MiB past a full {limit >> 20} MiB tier"


async def test_stores_and_loads_of_the_same_keys_at_once_never_show_a_chunk_half_written(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--tier-host-bytes", str(64 << 20))
    async with (
        AsyncKvxferClient(a.socket, engine_name="writer") as w,
        AsyncKvxferClient(a.socket, engine_name="other-writer") as w2,
        AsyncKvxferClient(a.socket, engine_name="reader") as r,
    ):
        src_bufs = filled(LAYOUT, 4)
        src = await w.register_pool(src_bufs, LAYOUT)
        src2 = await w2.register_pool(filled(LAYOUT, 4), LAYOUT)  # the same KV, another engine
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        dst = await r.register_pool(dst_bufs, LAYOUT)
        k = keys(48, seed=b"shared")
        ids = list(range(48))
        results = await asyncio.gather(
            w.tier_store(src, ids, k),
            w2.tier_store(src2, ids, k),
            *(r.tier_load(dst, ids, k) for _ in range(5)),
        )
        (s1, _), (s2, _), *loads = results
        assert s1 + s2 == 48  # each key stored once
        for n in loads:  # whatever a load saw complete is complete and exact
            assert blocks(LAYOUT, dst_bufs, ids[:n]) == blocks(LAYOUT, src_bufs, ids[:n])
        assert await r.tier_load(dst, ids, k) == 48
        assert blocks(LAYOUT, dst_bufs, ids) == blocks(LAYOUT, src_bufs, ids)


STORE_AND_WAIT = """
import sys, time, numpy as np
from kvxfer_client import HostBuffer, KvxferClient, Layout, ModelInfo
sys.path.insert(0, {root!r})
from tests.integration.test_tier import LAYOUT, filled, keys
with KvxferClient({socket!r}, engine_name="short-lived") as c:
    pool = c.register_pool(filled(LAYOUT, 7), LAYOUT)
    print(c.tier_store(pool, [1, 2, 3], keys(3, seed=b"gone")), flush=True)
    time.sleep(60)
"""


async def test_a_killed_engines_stored_blocks_are_still_served(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--tier-host-bytes", str(64 << 20))
    script = STORE_AND_WAIT.format(root=ROOT, socket=a.socket)
    # An engine process of its own, to be killed: nothing else of this test runs meanwhile.
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=ROOT, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "(3, 0)"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    async with AsyncKvxferClient(a.socket, engine_name="survivor") as e:
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        dst = await e.register_pool(dst_bufs, LAYOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _pools_of(a) > 1:  # noqa: ASYNC110 - another process's state
            await asyncio.sleep(0.05)  # the killed engine's session ends, its pool goes
        assert _pools_of(a) == 1
        assert await e.tier_load(dst, [10, 11, 12], keys(3, seed=b"gone")) == 3
        assert blocks(LAYOUT, dst_bufs, [10, 11, 12]) == blocks(LAYOUT, filled(LAYOUT, 7), [1, 2, 3])


def _pools_of(daemon: Daemon) -> int:
    return len(daemon.admin("ListPools", admin_pb2.ListPoolsRequest()).pools)


async def test_a_restarted_daemon_starts_with_an_empty_tier(cluster: Cluster) -> None:
    """The host tier is memory only: a daemon that restarts has nothing stored (and says so)."""
    a = cluster.daemon("a", "--tier-host-bytes", str(64 << 20))
    async with AsyncKvxferClient(a.socket, engine_name="engine") as e:
        pool = await e.register_pool(filled(LAYOUT, 8), LAYOUT)
        assert await e.tier_store(pool, [1, 2], keys(2)) == (2, 0)
    assert a.terminate() == 0
    a.start()
    async with AsyncKvxferClient(a.socket, engine_name="engine") as e:
        pool = await e.register_pool(filled(LAYOUT, 8), LAYOUT)
        assert await e.tier_lookup(pool, keys(2)) == 0
        assert tier_of(a).used_bytes == 0


async def test_hostile_tier_calls_are_refused_typed_and_the_tier_serves_on(cluster: Cluster) -> None:
    off = cluster.daemon("off")
    async with AsyncKvxferClient(off.socket, engine_name="engine") as e:
        pool = await e.register_pool(filled(LAYOUT, 1), LAYOUT)
        with pytest.raises(UnavailableError, match="tier_host_bytes"):
            await e.tier_lookup(pool, keys(1))
    a = cluster.daemon("a", "--tier-host-bytes", str(64 << 20))
    async with (
        AsyncKvxferClient(a.socket, engine_name="engine") as e,
        AsyncKvxferClient(a.socket, engine_name="stranger") as s,
    ):
        pool = await e.register_pool(filled(LAYOUT, 1), LAYOUT)
        k = keys(3)
        for call, error in (
            (e.tier_store(pool, [1, 2], k), InvalidRequestError),  # keys and blocks differ in count
            (e.tier_store(pool, [1, 2], [k[0], k[0]]), InvalidRequestError),  # a key twice
            (e.tier_store(pool, [1], [b"x" * 65]), InvalidRequestError),  # a key too long
            (e.tier_store(pool, [1], [b""]), InvalidRequestError),
            (e.tier_store(pool, [1], [k[0]], salt=b"s" * 65), InvalidRequestError),
            (e.tier_store(pool, [64], [k[0]]), InvalidRequestError),  # outside the pool
            (e.tier_load(pool, [1, 1], k[:2]), InvalidRequestError),  # one block twice
            (e.tier_lookup(pool, [k[0]] * 2 + [b""]), InvalidRequestError),
            (s.tier_store(pool.pool_id, [1], [k[0]]), PermissionDeniedError),  # not its pool
            (s.tier_load(pool.pool_id, [1], [k[0]]), PermissionDeniedError),
        ):
            with pytest.raises(error):
                await call
        assert await e.tier_store(pool, [1, 2, 3], k) == (3, 0)
        assert a.proc is not None and a.proc.poll() is None


def _disk_tier(cluster: Cluster, directory: str, *extra: str) -> Daemon:
    host, disk = 4 << 20, 64 << 20  # 32 blocks in memory, 512 on disk
    return cluster.daemon(
        "a", "--tier-host-bytes", str(host), "--tier-disk-dir", directory, "--tier-disk-bytes", str(disk), *extra
    )


async def test_chunks_evicted_from_memory_spill_to_disk_and_load_back_byte_exact(cluster: Cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    stale = tmp_path / "old.kvtier"
    stale.write_bytes(b"an earlier run's chunks")
    a = _disk_tier(cluster, str(tmp_path))
    assert not stale.exists()  # the tier starts clean
    async with AsyncKvxferClient(a.socket, engine_name="engine") as e:
        bufs = filled(LAYOUT, 11)
        pool = await e.register_pool(bufs, LAYOUT)
        conversations = [keys(32, seed=f"c{i}".encode()) for i in range(3)]
        for k in conversations:  # 12 MiB through 4 MiB of memory
            assert await e.tier_store(pool, list(range(32)), k) == (32, 0)
        t = tier_of(a)
        [ns] = t.namespaces
        assert t.used_bytes <= 4 << 20 and ns.disk_chunks >= 64 and ns.evictions >= 64
        assert await e.tier_lookup(pool, conversations[0]) == 32  # on disk, still stored
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        dst = await e.register_pool(dst_bufs, LAYOUT)
        assert await e.tier_load(dst, list(range(32, 64)), conversations[0]) == 32
        assert blocks(LAYOUT, dst_bufs, list(range(32, 64))) == blocks(LAYOUT, bufs, list(range(32)))
        t = tier_of(a)
        assert t.namespaces[0].disk_hits >= 32 and t.used_bytes <= 4 << 20
        assert t.disk_used_bytes <= t.disk_limit_bytes and t.namespaces[0].disk_failures == 0


async def test_what_the_disk_fails_to_keep_is_dropped_counted_and_never_served(cluster: Cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Three spills fail (fault point); a chunk's bytes on disk are then overwritten: a load
    stops before it, what it loaded is exact, and both kinds are counted."""
    a = _disk_tier(cluster, str(tmp_path), "--fault-injection", "--faults", "tier_disk_write=fail:3")
    async with AsyncKvxferClient(a.socket, engine_name="engine") as e:
        bufs = filled(LAYOUT, 12)
        pool = await e.register_pool(bufs, LAYOUT)
        first, second = keys(32, seed=b"first"), keys(32, seed=b"second")
        await e.tier_store(pool, list(range(16, 32)), first[16:])  # these leave memory first
        await e.tier_store(pool, list(range(16)), first[:16])
        await e.tier_store(pool, list(range(32)), second)  # first goes to disk: 3 writes fail
        [ns] = tier_of(a).namespaces
        assert ns.disk_failures == 3
        assert await e.tier_lookup(pool, first) == 16  # the prefix ends at the first dropped chunk
        [path] = list(tmp_path.glob("*.kvtier"))
        with open(path, "r+b") as fh:  # the disk now returns other bytes for every chunk there
            fh.write(b"\xff" * path.stat().st_size)
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        dst = await e.register_pool(dst_bufs, LAYOUT)
        assert await e.tier_load(dst, list(range(16)), first[:16]) == 0  # nothing of it is served
        assert not any(b.array().any() for b in dst_bufs)
        assert await e.tier_lookup(pool, first) == 0  # dropped
        assert tier_of(a).namespaces[0].disk_failures == 3 + 16  # each chunk read back is checked
        assert await e.tier_load(dst, list(range(32)), second) == 32  # memory still serves
        assert blocks(LAYOUT, dst_bufs, list(range(32))) == blocks(LAYOUT, bufs, list(range(32)))


@pytest.mark.parametrize("path", ["local", "ucx"])
async def test_an_offer_backed_by_the_tier_frees_the_engines_blocks_and_is_pulled_like_any(
    cluster: Cluster, path: str
) -> None:
    """The prefill engine stores its blocks, offers them from the tier, overwrites its blocks
    and exits; the decode engine (same daemon, or another over UCX) pulls the ticket and gets
    the KV as it was. The chunks stay pinned while offered: a tier of four chunks, all offered,
    takes no other store until the pull released them."""
    a = cluster.daemon("a", "--tier-host-bytes", str(4 * BLOCK), env={"KVXFERD_SAME_HOST_DIRECT_READ": "false"})
    b = a if path == "local" else cluster.daemon("b", env={"KVXFERD_SAME_HOST_DIRECT_READ": "false"})
    k = keys(4, seed=b"offered")
    async with AsyncKvxferClient(a.socket, engine_name="prefill") as p:
        src_bufs = filled(LAYOUT, 21)
        expected = blocks(LAYOUT, src_bufs, [2, 4, 6, 8])
        src = await p.register_pool(src_bufs, LAYOUT)
        assert await p.tier_store(src, [2, 4, 6, 8], k) == (4, 0)
        ticket = await p.tier_offer(src, k, lease_s=60)
        for buf in src_bufs:  # the engine reuses its blocks at once
            buf.array()[:] = 0
        assert await p.tier_store(src, [10], keys(1, seed=b"other")) == (0, 1)  # every chunk is pinned
        with pytest.raises(NotFoundError, match="1 of the 2 keys"):
            await p.tier_offer(src, [k[0], b"never stored"])
    async with AsyncKvxferClient(b.socket, engine_name="decode") as d:  # the prefill engine is gone
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        dst = await d.register_pool(dst_bufs, LAYOUT)
        result = await d.pull(ticket, dst, [30, 31, 32, 33])
        assert blocks(LAYOUT, dst_bufs, [30, 31, 32, 33]) == expected
        assert (result.transport == "local-copy") == (path == "local"), result.transport
    async with AsyncKvxferClient(a.socket, engine_name="prefill-again") as p:
        src = await p.register_pool(filled(LAYOUT, 22), LAYOUT)
        assert await p.tier_store(src, [10], keys(1, seed=b"other")) == (1, 0)  # unpinned: room again


async def test_a_tier_offer_of_canonical_chunks_serves_each_rank_of_another_tp_its_heads(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--tier-host-bytes", str(64 << 20))
    heads, tokens, block_tokens = 8, 48, 16
    logical = logical_kv(heads, tokens, seed=9)
    ids, k = [3, 8, 13], keys(3, seed=b"tp-offer")
    async with AsyncKvxferClient(a.socket, engine_name="prefill") as p:
        ref = HeadsPool.empty(rank_heads(heads, 1, 0), block_tokens, "NHD")
        ref.fill(logical, ids)
        layout = _rank_pool_layout(heads, 1, 0, "NHD", block_tokens)
        bufs = [HostBuffer.create(s) for s in layout.buffer_sizes()]
        for buf, arr in zip(bufs, ref.buffers, strict=True):
            buf.array()[:] = arr
        pool = await p.register_pool(bufs, layout)
        await p.tier_store(pool, ids, k)
        ticket = await p.tier_offer(pool, k, readers=2)
        for rank in range(2):
            async with AsyncKvxferClient(a.socket, engine_name=f"decode-{rank}") as d:
                layout = _rank_pool_layout(heads, 2, rank, "HND", block_tokens)
                rank_bufs = [HostBuffer.create(s) for s in layout.buffer_sizes()]
                await d.pull(ticket, await d.register_pool(rank_bufs, layout), [1, 2, 0])
                want = HeadsPool.empty(rank_heads(heads, 2, rank), block_tokens, "HND")
                for got, expected in zip(rank_bufs, want.expected(logical, [1, 2, 0], want.heads, tokens), strict=True):
                    np.testing.assert_array_equal(got.array(), expected)
        released = await p.wait_released(ticket.offer_id, 10)
        assert released.reason.name == "PULLED"


async def test_another_nodes_tier_is_looked_up_and_loaded_over_the_data_plane(cluster: Cluster) -> None:
    """Node b's engine asks node a's tier (a hint: a checks): the stored prefix is counted,
    offered and pulled over UCX into b's pool, byte-exact; b's own tier is not needed; a
    prefix a does not hold is a miss; a peer's hostile pool description is refused typed."""
    no_direct = {"KVXFERD_SAME_HOST_DIRECT_READ": "false"}
    a = cluster.daemon("a", "--tier-host-bytes", str(64 << 20), env=no_direct)
    b = cluster.daemon("b", env=no_direct)
    k = keys(6, seed=b"shared prefix")
    async with AsyncKvxferClient(a.socket, engine_name="node-a") as e:
        src_bufs = filled(LAYOUT, 31)
        src = await e.register_pool(src_bufs, LAYOUT)
        assert await e.tier_store(src, [1, 2, 3, 4], k[:4]) == (4, 0)
        expected = blocks(LAYOUT, src_bufs, [1, 2, 3, 4])
    async with AsyncKvxferClient(b.socket, engine_name="node-b") as d:
        dst_bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
        dst = await d.register_pool(dst_bufs, LAYOUT)
        assert await d.tier_lookup(dst, k, from_peer=a.info["peer_address"]) == 4
        assert await d.tier_lookup(dst, k, from_peer=a.info["peer_address"], salt=b"other tenant") == 0
        assert await d.tier_load(dst, [10, 11, 12, 13, 14, 15], k, from_peer=a.info["peer_address"]) == 4
        assert blocks(LAYOUT, dst_bufs, [10, 11, 12, 13]) == expected
        with pytest.raises(UnavailableError, match="tier_host_bytes"):
            await d.tier_lookup(dst, k)  # b has no tier of its own
    with grpc.insecure_channel(a.info["peer_address"]) as channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        for bad in (
            peer_pb2.PeerTierOfferRequest(daemon_id="b", keys=k),  # no pool described
            peer_pb2.PeerTierOfferRequest(daemon_id="b", signature=common_pb2.LayoutSignature(block_bytes=[0]), keys=k),
            peer_pb2.PeerTierOfferRequest(daemon_id="stranger", signature=LAYOUT.signature(), keys=k),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                stub.TierOffer(bad, timeout=5)
            assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    assert a.proc is not None and a.proc.poll() is None


async def test_routers_hear_of_keys_stored_and_removed_in_batches(cluster: Cluster) -> None:
    """WatchTier: a store of 32 blocks arrives as one batch naming every key; keys evicted
    from the node come as removed; kvxferctl tier --events prints the same."""
    a = cluster.daemon("a", "--tier-host-bytes", str(40 * BLOCK), "--tier-low-watermark", "0.5")
    async with (
        grpc.aio.insecure_channel("unix:" + a.socket) as channel,
        AsyncKvxferClient(a.socket, engine_name="engine") as e,
    ):
        pool = await e.register_pool(filled(LAYOUT, 41), LAYOUT)
        watch = admin_pb2_grpc.AdminServiceStub(channel).WatchTier(admin_pb2.WatchTierRequest())
        probes = await _until_heard(e, pool, lambda: watch.read(), "probe")
        first = keys(32, seed=b"first")
        await e.tier_store(pool, list(range(32)), first)
        batch = await asyncio.wait_for(watch.read(), 10)
        [stored] = batch.stored
        assert list(stored.keys) == first and not batch.removed
        await e.tier_store(pool, list(range(16)), keys(16, seed=b"second"))  # the oldest go
        removed: list[bytes] = []
        while len(removed) < probes + 16:
            batch = await asyncio.wait_for(watch.read(), 10)
            removed += [k for t in batch.removed for k in t.keys]
        assert [k for k in removed if k in first] == first[: len(removed) - probes]
        watch.cancel()
        cmd = [sys.executable, "-m", "kvxfer_client._ctl", "--socket", a.socket, "tier", "--events", "--count", "1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)  # noqa: ASYNC220
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline
            await _until_heard(e, pool, lambda: asyncio.to_thread(line), "ctl")
            assert proc.wait(10) == 0
        finally:
            proc.kill()


async def _until_heard(e: AsyncKvxferClient, pool: Pool, heard: Callable[[], Awaitable[Any]], tag: str) -> int:
    """Store fresh keys until the subscriber hears of one (it subscribed); returns how many."""
    pending: asyncio.Future[Any] = asyncio.ensure_future(heard())
    for n in range(1, 100):
        await e.tier_store(pool, [63], [f"{tag}-{n}".encode()])
        done, _ = await asyncio.wait({pending}, timeout=0.2)
        if done:
            got = pending.result()
            assert got and ("stored" in str(got)), got
            return n
    raise AssertionError("the subscriber never heard of a stored key")
