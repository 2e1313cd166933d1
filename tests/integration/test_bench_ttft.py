"""The TTFT proxy (bench/ttft.py) on one small size: every mode lands, and a layer-wise push of
a request over the streaming threshold finishes no later than its bound."""

from __future__ import annotations

import asyncio
from typing import Any

from bench import ttft


def test_the_ttft_proxy_measures_every_mode_and_streams_what_it_should() -> None:
    rows: list[dict[str, Any]] = []
    # 1024 tokens = 128 MiB (streamed, over the 64 MiB threshold); a slow prefill (50 ms a
    # layer) leaves the transfer far behind it, so only the last layers' share is exposed.
    asyncio.run(ttft.run_async([1024], 1, 1024 / 1.6, False, rows.append))
    [row] = rows
    assert row["mib"] == 128 and row["transport"] == "ucx"
    assert row["compute_ms"] >= 1500
    # Layer-wise hides nearly all of the transfer behind the compute; pull and push expose it.
    assert row["layerwise_within_bound"], row
    assert row["layerwise_ms"] < row["pull_ms"] - 0.5 * row["transfer_ms"], row
