"""The time-to-first-token proxy: prefill start → decode ready, per handoff mode.

A prefill is emulated layer by layer (``--prefill-tokens-per-s``, default 20,000: a Llama-3-8B
prefill on one H100 is of that order; the layers' time passes as the GPU's would, without the
CPU), on Llama-3-8B-shaped host pools (32 layers, 8 KV heads of 128, bf16, blocks of 16
tokens: 128 KiB of KV per token). Per request size, in rounds interleaved in one run:

* ``pull``: the prefill computes every layer, offers, and the decode engine pulls the ticket
  (the router's hop is left out: it only adds to pull);
* ``push``: the decode engine expects the transfer id from the start (the router dispatched
  both at once); the prefill computes every layer, then pushes;
* ``layerwise``: as push, but the prefill pushes before its first layer and says after each
  one that it is written (``layers_ready``): the daemon moves each layer (batch) as it comes,
  and requests under its ``layerwise_min_bytes`` go whole once written.

Also measured, same run: ``compute`` (the emulated prefill), ``transfer`` (the whole pull's
daemon time), ``fixed`` (a one-block handoff) and ``group`` (one batch's share of the
transfer). The bound for layer-wise is ``max(compute, transfer) + group + fixed`` where it
streams, ``compute + transfer + fixed`` where it goes whole (under ``layerwise_min_bytes``);
``overlap`` is the part of the transfer that layer-wise hid behind compute
(``(pull - layerwise) / transfer``).

The daemons read each other's memory over UCX (direct reads off), as daemons on two hosts
would; ``--direct`` lets them use same-host direct reads instead.

Run: ``python -m bench.ttft [--rounds 5] [--tokens 256,1024,4096,16384]``; one JSON line per
size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer_client import AsyncKvxferClient, HostBuffer, Layout, Pool
from kvxferd._config import Settings

from .cluster import Cluster

LAYERS = 32
BLOCK_TOKENS = 16
#: One layer's K (or V) of one 16-token block: 16 tokens x 8 heads x 128 x 2 bytes.
REGION_BYTES = BLOCK_TOKENS * 8 * 128 * 2


def _layout(blocks: int) -> Layout:
    return Layout.paged_kv(num_layers=LAYERS, num_blocks=blocks, block_bytes=REGION_BYTES)


class Engines:
    """A prefill and a decode engine (clients in this process) with Llama-8B-shaped pools."""

    def __init__(self, prefill: AsyncKvxferClient, decode: AsyncKvxferClient) -> None:
        self.p, self.d = prefill, decode
        self.src: Pool | None = None
        self.dst: Pool | None = None

    async def pools(self, blocks: int) -> None:
        layout = _layout(blocks)
        src = [HostBuffer.create(s) for s in layout.buffer_sizes()]
        for i, buf in enumerate(src):
            buf.array()[:] = np.random.default_rng(i).integers(0, 256, buf.size, dtype=np.uint8)
        dst = [HostBuffer.create(s) for s in layout.buffer_sizes()]
        for buf in dst:
            buf.array()[:] = 0  # touched once, as an engine's preallocated cache is
        self.src = await self.p.register_pool(src, layout, name="ttft-prefill")
        self.dst = await self.d.register_pool(dst, layout, name="ttft-decode")


async def _compute(start: float, per_layer_s: float, after_layer: Callable[[int], Any] | None = None) -> None:
    """The emulated prefill: layer k ends at ``start + (k + 1) * per_layer_s`` (an absolute
    schedule, so timer slack does not add up)."""
    for k in range(LAYERS):
        delay = start + (k + 1) * per_layer_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if after_layer is not None:
            await after_layer(k + 1)


async def one_round(e: Engines, blocks: int, per_layer_s: float) -> dict[str, float]:
    assert e.src is not None and e.dst is not None
    ids = list(range(blocks))
    out: dict[str, float] = {}

    # pull: compute, offer, pull.
    t0 = time.perf_counter()
    await _compute(t0, per_layer_s)
    out["compute"] = time.perf_counter() - t0
    ticket = await e.p.offer(e.src, ids)
    pulled = await e.d.pull(ticket, e.dst, ids, timeout_s=120)
    out["pull"] = time.perf_counter() - t0
    out["transfer"] = pulled.duration_s

    # push: the decode side expects it from the start; the prefill pushes once computed.
    tid = "ttft-" + secrets.token_hex(16)
    t0 = time.perf_counter()
    receiving = asyncio.create_task(e.d.receive(tid, e.dst, ids, timeout_s=120))
    await _compute(t0, per_layer_s)
    pushed = await e.p.push(e.src, ids, tid, e.d.peer_address)
    assert pushed.mode == "push", pushed
    await receiving
    out["push"] = time.perf_counter() - t0

    # layer-wise push: pushed before the first layer, each layer said written as it ends.
    tid = "ttft-" + secrets.token_hex(16)
    t0 = time.perf_counter()
    receiving = asyncio.create_task(e.d.receive(tid, e.dst, ids, timeout_s=120))
    pushed = await e.p.push(e.src, ids, tid, e.d.peer_address, layers=LAYERS)
    assert pushed.mode == "push", pushed
    ticket = pushed.ticket

    saying: list[asyncio.Task[None]] = []

    async def written(layers: int) -> None:
        # Said without waiting for the answer, as an engine's forward pass would: the next
        # layer's compute does not wait on the daemon (calls on the stream keep their order).
        saying.append(asyncio.create_task(e.p.layers_ready(ticket, layers)))

    await _compute(t0, per_layer_s, written)
    await receiving
    await asyncio.gather(*saying)
    out["layerwise"] = time.perf_counter() - t0

    # The fixed cost: a one-block handoff between the same engines.
    t0 = time.perf_counter()
    ticket = await e.p.offer(e.src, [0])
    await e.d.pull(ticket, e.dst, [0], timeout_s=30)
    out["fixed"] = time.perf_counter() - t0
    return out


async def run_async(
    tokens: list[int], rounds: int, tokens_per_s: float, direct: bool, emit: Callable[[dict[str, Any]], None]
) -> None:
    env = {"KVXFERD_SAME_HOST_DIRECT_READ": "true" if direct else "false"}
    with Cluster() as cluster:
        a, b = cluster.daemon("ttft-a", env=env), cluster.daemon("ttft-b", env=env)
        defaults = Settings()  # the daemons run on them
        batch, streamed_from = defaults.layerwise_batch_bytes, defaults.layerwise_min_bytes
        for n in tokens:
            blocks = -(-n // BLOCK_TOKENS)
            async with (
                AsyncKvxferClient(a.socket, engine_name="ttft-prefill") as p,
                AsyncKvxferClient(b.socket, engine_name="ttft-decode") as d,
            ):
                e = Engines(p, d)
                await e.pools(blocks)
                per_layer_s = n / tokens_per_s / LAYERS
                await one_round(e, blocks, per_layer_s)  # warm: endpoints, streams, first touch
                runs = [await one_round(e, blocks, per_layer_s) for _ in range(rounds)]
            med = {k: statistics.median(r[k] for r in runs) * 1e3 for k in runs[0]}
            nbytes = blocks * LAYERS * 2 * REGION_BYTES
            layer_bytes = nbytes / LAYERS
            streamed = nbytes >= streamed_from
            per_batch = max(1, int(-(-batch // layer_bytes))) if streamed else LAYERS  # layers a batch
            group = med["transfer"] * min(1.0, per_batch / LAYERS)
            bound = max(med["compute"], med["transfer"]) + group + med["fixed"]
            if not streamed:  # it goes whole, once the last layer is written
                bound = med["compute"] + med["transfer"] + med["fixed"]
            emit(
                {
                    "tokens": n,
                    "mib": nbytes / (1 << 20),
                    "transport": "direct" if direct else "ucx",
                    "streamed": streamed,
                    **{f"{k}_ms": round(v, 2) for k, v in med.items()},
                    "group_ms": round(group, 2),
                    "layerwise_bound_ms": round(bound, 2),
                    "layerwise_within_bound": med["layerwise"] <= bound,
                    "layerwise_vs_pull": round(med["layerwise"] / med["pull"], 3),
                    "push_vs_pull": round(med["push"] / med["pull"], 3),
                    "overlap": round((med["pull"] - med["layerwise"]) / med["transfer"], 3),
                }
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", default="256,1024,4096,16384")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    parser.add_argument("--direct", action="store_true", help="same-host direct reads instead of UCX")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)

    asyncio.run(run_async(tokens, args.rounds, args.prefill_tokens_per_s, args.direct, emit))


if __name__ == "__main__":
    main()
