"""The TTFT proxy (bench/ttft.py) on one small size: every mode lands; and a layer-wise push of
a request over the streaming threshold streams: its first layers reach the decode pool before
the prefill says its last layer is written.

How much of the transfer layer-wise hides is a speed figure: the bench reports it
(``overlap``, ``layerwise_within_bound``); a timed assertion here would only measure the load
of the machine running the suite.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import numpy as np

from bench import ttft
from bench.cluster import Cluster
from kvxfer_client import AsyncKvxferClient, HostBuffer

BLOCKS = 64  # 64 blocks x 32 layers x 2 x 64 KiB = 256 MiB: over the 64 MiB streaming threshold


def test_the_ttft_proxy_measures_every_mode() -> None:
    rows: list[dict[str, Any]] = []
    asyncio.run(ttft.run_async([1024], 1, 1024 / 1.6, False, rows.append))
    [row] = rows
    assert row["mib"] == 128 and row["transport"] == "ucx" and row["streamed"]
    assert row["compute_ms"] >= 1500
    for mode in ("pull", "push", "layerwise"):
        assert row[f"{mode}_ms"] >= row["compute_ms"], row  # none lands before its prefill ends


def test_a_layerwise_push_moves_the_first_layers_before_the_last_is_written() -> None:
    asyncio.run(_first_layers_land_early())


async def _first_layers_land_early() -> None:
    layout = ttft._layout(BLOCKS)
    src = [HostBuffer.create(s) for s in layout.buffer_sizes()]
    for i, buf in enumerate(src):
        buf.array()[:] = np.random.default_rng(i).integers(1, 256, buf.size, dtype=np.uint8)
    dst = [HostBuffer.create(s) for s in layout.buffer_sizes()]
    for buf in dst:
        buf.array()[:] = 0
    ids = list(range(BLOCKS))
    with Cluster() as cluster:
        a = cluster.daemon("lw-a", env={"KVXFERD_SAME_HOST_DIRECT_READ": "false"})
        b = cluster.daemon("lw-b", env={"KVXFERD_SAME_HOST_DIRECT_READ": "false"})
        async with (
            AsyncKvxferClient(a.socket, engine_name="lw-prefill") as p,
            AsyncKvxferClient(b.socket, engine_name="lw-decode") as d,
        ):
            src_pool = await p.register_pool(src, layout, name="lw-prefill")
            dst_pool = await d.register_pool(dst, layout, name="lw-decode")
            tid = "lw-" + secrets.token_hex(16)
            receiving = asyncio.create_task(d.receive(tid, dst_pool, ids, timeout_s=120))
            pushed = await p.push(src_pool, ids, tid, d.peer_address, layers=ttft.LAYERS)
            await p.layers_ready(pushed.ticket, ttft.LAYERS - 1)
            # Layer 0's buffer lands while the last layer is still unwritten (bounded wait).
            deadline = time.monotonic() + 60
            while not np.array_equal(dst[0].array(), src[0].array()):
                assert not receiving.done(), "the receive ended before the last layer was written"
                assert time.monotonic() < deadline, "layer 0 never landed before the last layer"
                await asyncio.sleep(0.01)
            assert not receiving.done()
            assert not dst[-1].array().any(), "the last layer moved before it was said written"
            await p.layers_ready(pushed.ticket, ttft.LAYERS)
            await receiving
    for s, t in zip(src, dst, strict=True):
        assert np.array_equal(s.array(), t.array())
