"""``KvxferStats``: the connector's transfer counters in vLLM's connector stats.

Each worker snapshots its counters once per step (and starts from zero); vLLM adds the ranks'
snapshots together, then the intervals', and logs ``reduce()`` as "KV Transfer metrics: ...".
Counts and sums only, so adding is exact whatever the order.

>>> a = KvxferStats({"pulls": 2, "pulled_bytes": 3 << 20, "pull_seconds": 0.002, "pull_failures": 0, "offers": 1})
>>> total = a.aggregate(KvxferStats({"pulls": 1, "pull_failures": 1}))
>>> total.reduce()["pulls"], total.reduce()["pull_failures"], total.reduce()["pulled_MiB"]
(3, 1, 3.0)
>>> KvxferStats().is_empty()
True
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["COUNTERS", "KvxferStats"]

#: What a worker counts (``WorkerTransfers.stats``): integers, and seconds as a float. Pulls
#: count receives too (a streamed request's decode side); pushes count streamed prefills;
#: tier saves count requests stored into the node's KV tier, tier loaded blocks the blocks a
#: stored prefix brought back.
COUNTERS = (
    "pulls",
    "pull_failures",
    "pull_expired",
    "pulled_bytes",
    "pull_seconds",
    "offers",
    "pushes",
    "tier_saves",
    "tier_loaded_blocks",
)


class KvxferStats(KVConnectorStats):
    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data={k: (data or {}).get(k, 0) for k in COUNTERS})

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KvxferStats:
        return KvxferStats({k: self.data[k] + other.data.get(k, 0) for k in COUNTERS})

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        done = d["pulls"] - d["pull_failures"]
        seconds = float(d["pull_seconds"])
        return {
            "pulls": int(d["pulls"]),
            "pull_failures": int(d["pull_failures"]),
            "pull_expired": int(d["pull_expired"]),
            "offers": int(d["offers"]),
            "pushes": int(d["pushes"]),
            "tier_saves": int(d["tier_saves"]),
            "tier_loaded_blocks": int(d["tier_loaded_blocks"]),
            "pulled_MiB": round(d["pulled_bytes"] / (1 << 20), 3),
            "avg_pull_ms": round(1e3 * seconds / done, 3) if done else 0.0,
            "pull_GBps": round(d["pulled_bytes"] / seconds / 1e9, 3) if seconds else 0.0,
        }
