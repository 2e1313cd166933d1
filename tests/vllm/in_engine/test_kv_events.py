"""The connector's KV events of tier stores and loads, as the scheduler counts the workers'
reports (see kvxfer_client/vllm/_kv_events.py): published once every rank reported, across
steps; never when a rank failed; never twice. Run inside the vLLM venv."""

from __future__ import annotations

from vllm.distributed.kv_events import BlockStored

from kvxfer_client.vllm._kv_events import RankReports, WorkerEvents, stored_event

HASHES = [b"h0", b"h1", b"h2", b"h3"]
TOKENS = list(range(100, 116))


def test_an_event_waits_for_every_rank_even_across_steps_and_is_published_once() -> None:
    event = stored_event(HASHES, TOKENS, first=0, count=2, block_size=4)
    reports = RankReports()
    reports.add(WorkerEvents([("r1", "store", event)]))  # rank 0, step 1
    assert reports.ready(ranks=2) == []
    reports.add(WorkerEvents([("r1", "store", event)]))  # rank 1, step 2
    assert reports.ready(ranks=2, ended={("r1", "store")}) == [event]
    assert reports.ready(ranks=2) == []


def test_a_store_that_failed_on_one_rank_is_never_published() -> None:
    event = stored_event(HASHES, TOKENS, first=1, count=3, block_size=4)
    reports = RankReports()
    reports.add(WorkerEvents([("r2", "load", event)]))  # rank 0 loaded; rank 1 failed: no report
    assert reports.ready(ranks=2, ended={("r2", "load")}) == []  # vLLM heard it ended on both
    reports.add(WorkerEvents([("r2", "load", event)]))  # a late duplicate must not revive it
    assert reports.ready(ranks=2) == []


def test_two_requests_storing_the_same_blocks_are_counted_apart() -> None:
    event = stored_event(HASHES, TOKENS, first=0, count=4, block_size=4)
    reports = RankReports()
    reports.add(WorkerEvents([("a", "store", event), ("b", "store", event)]))  # rank 0 of 2, both requests
    assert reports.ready(ranks=2) == [], "one rank's two reports are not two ranks"
    reports.add(WorkerEvents([("a", "store", event)]))
    assert reports.ready(ranks=2) == [event]


def test_the_event_names_the_blocks_as_vllm_does() -> None:
    event = stored_event(HASHES, TOKENS, first=2, count=2, block_size=4)
    assert isinstance(event, BlockStored) and event.medium == "CPU" and event.block_size == 4
    assert event.token_ids == TOKENS[8:16] and len(event.block_hashes) == 2
    assert event.parent_block_hash is not None and stored_event(HASHES, TOKENS, 0, 1, 4).parent_block_hash is None


def test_containers_that_are_not_ours_are_ignored() -> None:
    reports = RankReports()
    reports.add(None)
    reports.add(object())
    assert reports.ready(ranks=1) == []
