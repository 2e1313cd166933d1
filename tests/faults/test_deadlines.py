"""A pull that runs out of time fails in bounded time and writes nothing afterwards."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from bench.cluster import Cluster
from kvxfer_client import AsyncKvxferClient, DeadlineExceededError, HostBuffer, Layout, ReleaseReason

LAYOUT = Layout.paged_kv(num_layers=8, num_blocks=1024, block_bytes=16 << 10)  # 256 MiB per pool


@pytest.mark.parametrize("iov", [True, False], ids=["iov-receive", "staged-receive"])
async def test_a_timed_out_remote_pull_stops_writing_before_it_returns(cluster: Cluster, iov: bool) -> None:
    # 64 KiB chunks (4 fragmented segments each) one at a time: the 128 MiB pull takes far
    # longer than its 0.05 s deadline.
    slow = ["--chunk-bytes", "65536", "--window", "1"]
    a = cluster.daemon("a", *slow)
    b = cluster.daemon("b", *slow, *([] if iov else ["--no-ucx-iov-receive"]))
    p = await AsyncKvxferClient(a.socket, engine_name="p").connect()
    d = await AsyncKvxferClient(b.socket, engine_name="d").connect()
    src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    for buf in src:
        buf.array()[:] = np.random.default_rng(1).integers(1, 256, buf.size, dtype=np.uint8)
    dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    ppool, dpool = await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT)
    # Warm up (Hello, UCX endpoint) so that the deadline below falls inside the data transfer.
    # A deadline before the prefill daemon claims the offer leaves the offer available instead.
    warm = await p.offer(ppool, [1, 3])
    await d.pull(warm, dpool, [0, 2], timeout_s=30)
    ticket = await p.offer(ppool, list(range(0, 1024, 2)))

    # A deadline that passes before the prefill daemon claims the offer leaves the offer
    # available (nothing moved, nothing to release); on a loaded machine the claim can take
    # longer than 0.05 s, so the deadline grows until it falls inside the data transfer.
    released = None
    for deadline_s in (0.05, 0.1, 0.2, 0.4):
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await d.pull(ticket, dpool, list(range(1, 1024, 2)), timeout_s=deadline_s)
        assert time.monotonic() - t0 < 2.0

        # Whatever landed before the failure stays as it is: no late chunk writes afterwards.
        snapshot = [buf.array().copy() for buf in dst]
        await asyncio.sleep(1.0)
        assert all(np.array_equal(s, buf.array()) for s, buf in zip(snapshot, dst, strict=True))
        try:
            released = await p.wait_released(ticket.offer_id, timeout_s=5)
            break
        except DeadlineExceededError:
            continue  # never claimed: the offer is still there, try a later deadline
    assert released is not None, "no deadline up to 0.4 s fell inside the 128 MiB transfer"
    assert released.reason is ReleaseReason.FAILED
    # Both daemons stay usable: a fresh offer of the same blocks goes through in full.
    again = await p.offer(ppool, [0, 2])
    result = await d.pull(again, dpool, [5, 7], timeout_s=30)
    assert result.bytes == 2 * LAYOUT.bytes_per_block
    await p.close()
    await d.close()
