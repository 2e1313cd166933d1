"""Remapped handoffs next to plain ones moving the same bytes, in one run: what a decode rank of
another TP size, head order or block size costs.

Llama-3-8B's KV (32 layers, 8 KV heads, head dim 128, bf16: 256 bytes per head and token),
2048 tokens per request. Every case moves the same 128 MiB into its decode pool:

* ``plain``: 4 heads on both sides, same geometry (the stream as it is; the reference);
* ``sliced``: prefill TP 1 (8 heads) to decode rank 0 of TP 2 (heads 0..3): half of every
  block, one run per block and layer;
* ``reblocked``: plain, but prefill blocks of 16 tokens into decode blocks of 32;
* ``reordered``: plain, but prefill tokens-major (NHD) into decode heads-major (HND): one
  256-byte piece per head and token.

The target: ``sliced`` at >= 0.8 of ``plain`` (``ratio_vs_plain``, from the daemon's time).
Measured on the 2-core development VM (``--iters 6``), local / remote: sliced 0.90 / 0.83,
reblocked 0.79 / 0.96, reordered 0.38 / 0.47. A reordered pull's bytes move as fast as plain
ones (``data_plane_ratio_vs_plain`` 0.83 / 0.85); the rest is planning its 524,288 pieces
(about 20 ms, off the event loop).

Run: ``python -m bench.sliced [--iters 16]`` (``python -m bench`` runs it as workload ``sliced``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from .cluster import Cluster, Daemon, EngineProcess

LAYERS, HEADS, HEAD_BYTES, TOKENS = 32, 8, 256, 2048
#: (name, prefill TP, prefill order, prefill block, decode TP, decode order, decode block)
CASES = (
    ("plain", 2, "HND", 16, 2, "HND", 16),
    ("sliced", 1, "HND", 16, 2, "HND", 16),
    ("reblocked", 2, "HND", 16, 2, "HND", 32),
    ("reordered", 2, "NHD", 16, 2, "HND", 16),
)


def _pool(engine: EngineProcess, tp: int, order: str, block: int, seed: int | None) -> int:
    heads = HEADS // tp
    blocks = 2 * TOKENS // block  # room for two requests' worth of random block ids
    block_bytes = block * heads * HEAD_BYTES
    engine(
        "pool",
        shape={"layers": LAYERS, "blocks": blocks, "block_bytes": block_bytes},
        model={"model": "llama-3-8b-shape", "dtype": "bfloat16", "block_tokens": block, "tp_size": tp, "tp_rank": 0},
        geometry={"block_tokens": block, "total_kv_heads": HEADS, "head_bytes": HEAD_BYTES, "order": order},
        seed=seed,
    )
    return blocks


class _Pair:
    """One case's prefill and decode engines, and its measurements."""

    def __init__(self, cluster: Cluster, a: Daemon, decode_daemon: Daemon, case: tuple[Any, ...], tag: str) -> None:
        self.name, p_tp, p_order, self.p_block, d_tp, d_order, self.d_block = case
        self.prefill = cluster.engine(a, f"p-{self.name}-{tag}")
        self.decode = cluster.engine(decode_daemon, f"d-{self.name}-{tag}")
        self.p_blocks = _pool(self.prefill, p_tp, p_order, self.p_block, seed=3)
        self.d_blocks = _pool(self.decode, d_tp, d_order, self.d_block, seed=None)
        self.daemon_s: list[float] = []
        self.data_s: list[float] = []
        self.nbytes, self.mapping = 0, ""

    def handoff(self, rng: np.random.Generator, record: bool) -> None:
        src = rng.permutation(self.p_blocks)[: TOKENS // self.p_block].tolist()
        dst = rng.permutation(self.d_blocks)[: TOKENS // self.d_block].tolist()
        [ticket] = self.prefill("offer", requests=[src])["tickets"]
        [res] = self.decode("pull", pulls=[[ticket, dst]])["results"]
        if not res["ok"]:
            raise RuntimeError(f"{self.name}: {res}")
        self.prefill("released", offer_ids=[ticket["offer_id"]])
        if record:
            self.daemon_s.append(res["daemon_s"])
            self.data_s.append(res["data_plane_s"])
            self.nbytes, self.mapping = res["bytes"], res["mapping"]

    def row(self) -> dict[str, Any]:
        n = len(self.daemon_s)
        return {
            "case": self.name,
            "mapping": self.mapping or "(none)",
            "request_bytes": self.nbytes,
            "handoffs": n,
            "gbps_daemon": self.nbytes * n / sum(self.daemon_s) / 1e9,
            "gbps_data_plane": self.nbytes * n / sum(self.data_s) / 1e9,
            "daemon_p50_ms": statistics.median(self.daemon_s) * 1e3,
        }


def run(iters: int, emit: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Per path, the cases take turns handoff by handoff (a slow spell of the machine falls on
    all of them alike); ratios are against ``plain`` of the same path."""
    rows = []
    rng = np.random.default_rng(5)
    with Cluster() as cluster:
        ucx_only = {"KVXFERD_SAME_HOST_DIRECT_READ": "false"}  # the remote path as between hosts
        a, b = cluster.daemon("sliced-a", env=ucx_only), cluster.daemon("sliced-b", env=ucx_only)
        for path, daemon in (("local", a), ("remote", b)):
            pairs = [_Pair(cluster, a, daemon, case, path) for case in CASES]
            for i in range(iters + 2):
                for pair in pairs:
                    pair.handoff(rng, record=i >= 2)
            by = {pair.name: {"workload": "sliced", "path": path, **pair.row()} for pair in pairs}
            for row in by.values():
                row["ratio_vs_plain"] = row["gbps_daemon"] / by["plain"]["gbps_daemon"]
                row["data_plane_ratio_vs_plain"] = row["gbps_data_plane"] / by["plain"]["gbps_data_plane"]
                rows.append(row)
                emit(row)
            for pair in pairs:
                pair.prefill.close()
                pair.decode.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=16)
    args = parser.parse_args()
    run(args.iters, lambda row: print(json.dumps(row), flush=True))


if __name__ == "__main__":
    main()
