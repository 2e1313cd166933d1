"""What the connector's ``request_finished`` adds to vLLM's scheduler loop, per request.

The scheduler answers with tickets made in advance and starts the offers on the client's
thread without waiting for them. This measures that call, as the scheduler thread sees it,
next to a blocking offer (one round trip to the daemon), both against a real daemon, with a
pool of process memory as a vLLM worker registers it. Block ids follow a 2048-token request at
block 16 (128 blocks).

Run: ``python -m bench.vllm_scheduler_cost [--requests 2000]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvxfer.ticket import Ticket
from kvxfer_client import KvxferClient, Layout, PoolRef
from kvxfer_client.vllm._messages import RankPool
from kvxfer_client.vllm._plan import SchedulerPlan

from .cluster import Cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    layout = Layout.paged_kv(num_layers=4, num_blocks=4096, block_bytes=2048)
    with Cluster() as cluster:
        daemon = cluster.daemon("a", "--max-offers", "1000000")
        worker = KvxferClient(daemon.socket, engine_name="worker")
        pool = worker.register_pool([np.zeros(s, dtype=np.uint8) for s in layout.buffer_sizes()], layout)
        scheduler = KvxferClient(daemon.socket, engine_name="scheduler")
        plan = SchedulerPlan(block_size=16)
        rank = RankPool(0, worker.daemon_id, worker.peer_address, pool.pool_id, pool.fingerprint, 4 * 2048 * 2, "")
        plan.set_pools({0: rank})
        key = pool.offer_key
        rng = np.random.default_rng(1)
        answered, blocking = [], []
        for _ in range(200):  # first alone: one round trip each, nothing else queued
            ids = rng.permutation(4096)[:128].tolist()
            t0 = time.perf_counter()
            scheduler.offer(PoolRef(pool.pool_id, key), ids, lease_s=600)
            blocking.append(time.perf_counter() - t0)
        futures = []
        for i in range(args.requests):
            ids = rng.permutation(4096)[:128].tolist()
            t0 = time.perf_counter()
            _, _, send = plan.finished(f"r{i}", {"do_remote_decode": True}, ids)
            assert send is not None
            ticket = Ticket.from_dict(send.tickets[0])
            futures.append(scheduler.start_offer(PoolRef(pool.pool_id, key), ids, lease_s=600, ticket=ticket))
            answered.append(time.perf_counter() - t0)
            plan.take()
        failed = sum(1 for f in futures if f.exception(timeout=60) is not None)
        print(
            json.dumps(
                {
                    "requests": args.requests,
                    "request_finished_us_median": statistics.median(answered) * 1e6,
                    "request_finished_us_p99": float(np.percentile(answered, 99)) * 1e6,
                    "blocking_offer_us_median": statistics.median(blocking) * 1e6,
                    "blocking_offer_us_p99": float(np.percentile(blocking, 99)) * 1e6,
                    "offers_failed": failed,
                }
            )
        )
        worker.close()
        scheduler.close()


if __name__ == "__main__":
    main()
