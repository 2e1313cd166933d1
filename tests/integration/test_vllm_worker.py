"""The vLLM connector's worker side (``WorkerTransfers``, no vLLM needed) against a real daemon:
how pulls that fail reach vLLM, and when their blocks may be reused."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import numpy as np
import pytest

from bench.cluster import Cluster
from kvxfer.layout import ModelInfo
from kvxfer_client import UnavailableError
from kvxfer_client.vllm._loads import Loading
from kvxfer_client.vllm._messages import Load
from kvxfer_client.vllm._worker import WorkerTransfers

NUM_BLOCKS = 16


def _wait_polled(worker: WorkerTransfers, rid: str, limit_s: float = 10.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        _, receiving, failed = worker.poll()
        if rid in receiving:
            return receiving, failed
        time.sleep(0.01)
    raise AssertionError(f"{rid} never reported")


@pytest.fixture
def worker(cluster: Cluster) -> Iterator[WorkerTransfers]:
    daemon = cluster.daemon("a")
    w = WorkerTransfers(daemon.socket, "test-decode", tp_rank=0, lease_s=10, pull_timeout_s=10)
    kv = np.zeros((NUM_BLOCKS, 1, 16, 64), dtype=np.uint16)  # the CPU backend's block-outermost shape
    w.register({"layer0": kv}, NUM_BLOCKS, ModelInfo("tiny", "bfloat16", 16, 1, 0))
    yield w
    w.close()


def test_a_failed_pull_is_reported_at_once_with_its_blocks_as_load_errors(worker: WorkerTransfers) -> None:
    assert worker.pool is not None
    ticket = worker.client.new_ticket(worker.pool, 2).to_dict()
    ticket["token"] = "00" * 16  # forged: the daemon refuses it
    worker.start([Load("r1", (ticket,), (4, 5), None)], [])
    receiving, failed = _wait_polled(worker, "r1")
    assert receiving == failed == {"r1"}
    assert worker.take_load_errors() == {4, 5}
    assert worker.totals["pull_failures"] == 1


def test_blocks_a_failed_pull_may_still_write_are_held_back_until_the_quarantine_ends(
    worker: WorkerTransfers,
) -> None:
    # What the daemon reports when UCX did not confirm the receives cancelled (made here: the
    # real window cannot be hit on demand); the worker's policy is what is under test.
    worker.quarantine_s = 0.5
    future: concurrent.futures.Future[object] = concurrent.futures.Future()
    future.set_exception(UnavailableError("peer gone mid-pull", may_still_write=True))
    worker._loading["r2"] = Loading("r2", (7, 8), [future])  # type: ignore[list-item]
    started = time.monotonic()
    assert worker.poll() == (set(), set(), set())  # not handed back: vLLM would reuse the blocks
    assert worker.take_load_errors() == set()
    receiving, failed = _wait_polled(worker, "r2")
    assert time.monotonic() - started >= 0.5
    assert receiving == failed == {"r2"} and worker.take_load_errors() == {7, 8}


def test_a_tensor_parallel_mismatch_is_a_failed_load_not_an_exception(worker: WorkerTransfers) -> None:
    assert worker.pool is not None
    tickets = tuple(worker.client.new_ticket(worker.pool, 1).to_dict() for _ in range(2))  # a TP-2 prefill
    worker.start([Load("r3", tickets, (9,), None)], [])  # returns: a step must not raise
    receiving, failed = _wait_polled(worker, "r3")
    assert receiving == failed == {"r3"} and worker.take_load_errors() == {9}
