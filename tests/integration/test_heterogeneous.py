"""Prefill and decode with other tensor parallelism, head order and block size, through real
daemons and engine processes (host pools), checked byte by byte against the reference model
of ``bench/heads.py``.

Each engine process registers one TP rank's pool with its ``KvGeometry``; the decode ranks
pull their heads from the prefill ranks ``head_sources`` names, into their own blocks. One
offer serves as many pulls as it has readers and is released as pulled after the last one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from bench.cluster import Cluster, Daemon, wait_for
from bench.heads import HEAD_BYTES, LAYERS, POOL_BLOCKS, Pool, engine_with, logical_kv, pool_bytes
from kvxfer.geometry import head_sources, rank_heads, readers

TOKENS = 45  # three blocks of 16, the last partly filled


def _handoff(
    cluster: Cluster,
    *,
    heads: int,
    prefill: tuple[int, str, int],
    decode: tuple[int, str, int],
    decode_daemon: Daemon,
    tag: str,
) -> list[dict[str, Any]]:
    """Prefill TP ranks offer (with their readers), decode TP ranks pull from their sources;
    every decode pool is checked against the reference. Returns the pull results."""
    (p_tp, p_order, p_block), (d_tp, d_order, d_block) = prefill, decode
    logical = logical_kv(heads, TOKENS, seed=len(tag))
    rng = np.random.default_rng(7)
    p_ids = rng.permutation(POOL_BLOCKS)[: -(-TOKENS // p_block)].tolist()
    prefills, tickets = [], []
    for rank in range(p_tp):
        pool = Pool.empty(rank_heads(heads, p_tp, rank), p_block, p_order)
        pool.fill(logical, p_ids)
        engine = engine_with(cluster, cluster.daemons[0], f"p{rank}-{tag}", pool, heads, p_tp, rank)
        n = readers(heads, p_tp, d_tp, rank)
        tickets.append(engine("offer", requests=[p_ids], readers=max(n, 1), lease_s=30)["tickets"][0] if n else None)
        prefills.append(engine)
    results = []
    for rank in range(d_tp):
        pool = Pool.empty(rank_heads(heads, d_tp, rank), d_block, d_order)
        engine = engine_with(cluster, decode_daemon, f"d{rank}-{tag}", pool, heads, d_tp, rank)
        d_ids = rng.permutation(POOL_BLOCKS)[: -(-TOKENS // d_block)].tolist()
        for source in head_sources(heads, p_tp, d_tp, rank):
            [result] = engine("pull", pulls=[[tickets[source.tp_rank], d_ids]])["results"]
            assert result["ok"], result
            results.append(result)
        for got, want in zip(pool_bytes(engine), pool.expected(logical, d_ids, pool.heads, TOKENS), strict=True):
            np.testing.assert_array_equal(got, want)
    for engine, ticket in zip(prefills, tickets, strict=True):
        if ticket is not None:
            assert engine("released", offer_ids=[ticket["offer_id"]])["reasons"] == ["pulled"]
    return results


@pytest.mark.parametrize("path", ["local", "remote"])
def test_decode_tp2_ranks_each_pull_their_heads_of_one_offer_released_after_both(
    two_daemons: Cluster, path: str
) -> None:
    a, b = two_daemons.daemons
    logical = logical_kv(8, TOKENS, seed=3)
    src = Pool.empty(rank_heads(8, 1, 0), 16, "HND")
    ids = [4, 9, 1]
    src.fill(logical, ids)
    prefill = engine_with(two_daemons, a, f"p-tp12-{path}", src, 8, 1, 0)
    [ticket] = prefill("offer", requests=[ids], readers=2, lease_s=30)["tickets"]
    assert ticket["readers"] == 2
    for rank in range(2):
        dst = Pool.empty(rank_heads(8, 2, rank), 16, "HND")
        decode = engine_with(two_daemons, a if path == "local" else b, f"d{rank}-tp12-{path}", dst, 8, 2, rank)
        [result] = decode("pull", pulls=[[ticket, [0, 5, 7]]])["results"]
        assert result["ok"] and result["path"] == path, result
        assert result["mapping"] == f"TP 1->2 (heads {4 * rank}..{4 * rank + 3})"
        assert result["bytes"] == LAYERS * 2 * 48 * 4 * HEAD_BYTES  # 3 blocks of 16 tokens, 4 of 8 heads
        for got, want in zip(pool_bytes(decode), dst.expected(logical, [0, 5, 7], dst.heads, TOKENS), strict=True):
            np.testing.assert_array_equal(got, want)
        if rank == 0:  # one reader of two: the offer waits for the other
            waited = prefill.call("released", offer_ids=[ticket["offer_id"]], timeout_s=0.3)
            assert not waited["ok"] and waited["type"] == "DeadlineExceededError", waited
    assert prefill("released", offer_ids=[ticket["offer_id"]])["reasons"] == ["pulled"]


def test_prefill_tp2_to_decode_tp1_gathers_both_ranks_heads_into_one_pool(two_daemons: Cluster) -> None:
    results = _handoff(
        two_daemons,
        heads=8,
        prefill=(2, "HND", 16),
        decode=(1, "HND", 16),
        decode_daemon=two_daemons.daemons[1],
        tag="tp21",
    )
    assert [r["mapping"] for r in results] == ["TP 2->1 (heads 0..3)", "TP 2->1 (heads 4..7)"]


def test_ranks_sharing_a_replicated_head_each_get_it(two_daemons: Cluster) -> None:
    """Two KV heads, decode TP 4: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1; the one
    prefill offer serves all four."""
    results = _handoff(
        two_daemons,
        heads=2,
        prefill=(1, "HND", 16),
        decode=(4, "HND", 16),
        decode_daemon=two_daemons.daemons[0],
        tag="rep",
    )
    assert len(results) == 4 and all(r["path"] == "local" for r in results)


def test_head_order_and_block_size_change_in_the_same_copy_between_daemons(two_daemons: Cluster) -> None:
    results = _handoff(
        two_daemons,
        heads=8,
        prefill=(1, "NHD", 16),
        decode=(2, "HND", 32),
        decode_daemon=two_daemons.daemons[1],
        tag="reorder",
    )
    assert results[0]["mapping"] == "TP 1->2 (heads 0..3), NHD->HND, block 16->32 tokens"
    assert all(r["path"] == "remote" for r in results)


def test_a_reader_that_never_comes_leaves_the_offer_to_its_lease(two_daemons: Cluster) -> None:
    a = two_daemons.daemons[0]
    logical = logical_kv(8, TOKENS, seed=4)
    src = Pool.empty(rank_heads(8, 1, 0), 16, "HND")
    src.fill(logical, [0, 1, 2])
    prefill = engine_with(two_daemons, a, "p-lonely", src, 8, 1, 0)
    [ticket] = prefill("offer", requests=[[0, 1, 2]], readers=2, lease_s=1.5)["tickets"]
    decode = engine_with(two_daemons, a, "d-lonely", Pool.empty(rank_heads(8, 2, 0), 16, "HND"), 8, 2, 0)
    assert decode("pull", pulls=[[ticket, [3, 4, 5]]])["results"][0]["ok"]
    released = prefill("released", offer_ids=[ticket["offer_id"]], timeout_s=10)
    assert released["reasons"] == ["expired"]
    assert "1 of its 2 readers" in released["details"][0]


def test_mla_ranks_behind_one_daemon_read_the_offer_once_over_the_wire(cluster: Cluster) -> None:
    """MLA: one latent "head" every decode rank holds whole. Four decode ranks behind daemon
    b pull one prefill offer (four readers) from daemon a: the first pull goes over the wire,
    the three that come while it runs join it and get the bytes by a local copy on b. The
    offerer serves one transfer, counts four readers and releases the offer as pulled.

    The offerer holds the first pull at ``after_accepted`` until the others have come: the
    test starts them once that pause has been hit (its log line), so they always find it."""
    a = cluster.daemon("a", "--fault-injection", "--faults", "after_accepted=pause:4")
    b = cluster.daemon("b")
    logical = logical_kv(1, TOKENS, seed=11)
    p_ids = [5, 2, 9]
    src = Pool.empty(rank_heads(1, 1, 0), 16, "HND")
    src.fill(logical, p_ids)
    prefill = engine_with(cluster, a, "p-mla", src, 1, 1, 0)
    [ticket] = prefill("offer", requests=[p_ids], readers=4, lease_s=60)["tickets"]
    pools = [Pool.empty(rank_heads(1, 4, rank), 16, "HND") for rank in range(4)]
    decodes = [engine_with(cluster, b, f"d{rank}-mla", pools[rank], 1, 4, rank) for rank in range(4)]
    d_ids = [[1, 2, 3], [7, 0, 4], [3, 9, 11], [20, 21, 22]]
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(decodes[0], "pull", pulls=[[ticket, d_ids[0]]])
        wait_for(lambda: "fault.hit" in a.log(), "the offerer to hold the first pull")
        rest = [pool.submit(decodes[r], "pull", pulls=[[ticket, d_ids[r]]]) for r in range(1, 4)]
        results = [f.result()["results"][0] for f in (first, *rest)]
    assert all(r["ok"] for r in results), results
    assert [r["transport"] == "shared" for r in results] == [False, True, True, True], results
    for engine, pool_, ids in zip(decodes, pools, d_ids, strict=True):
        for got, want in zip(pool_bytes(engine), pool_.expected(logical, ids, pool_.heads, TOKENS), strict=True):
            np.testing.assert_array_equal(got, want)
    assert prefill("released", offer_ids=[ticket["offer_id"]])["reasons"] == ["pulled"]
    served = [t for t in _ctl(a, "transfers", "--all") if t["offer"] == ticket["offer_id"]]
    assert len(served) == 1 and served[0]["state"] == "succeeded", served
    pulled = {t["transfer"]: t for t in _ctl(b, "transfers", "--all") if t["offer"] == ticket["offer_id"]}
    assert "read once for 4 readers" in pulled[results[0]["transfer_id"]]["detail"]
    assert all(results[0]["transfer_id"] in pulled[r["transfer_id"]]["detail"] for r in results[1:])


def test_a_reader_that_cannot_join_pulls_on_its_own(cluster: Cluster) -> None:
    """Readers of one MLA offer that come one after another each read over the wire (nothing
    runs to join), and the offer is released after the last of its readers."""
    a, b = cluster.daemon("a"), cluster.daemon("b")
    logical = logical_kv(1, TOKENS, seed=12)
    src = Pool.empty(rank_heads(1, 1, 0), 16, "HND")
    src.fill(logical, [0, 1, 2])
    prefill = engine_with(cluster, a, "p-mla2", src, 1, 1, 0)
    [ticket] = prefill("offer", requests=[[0, 1, 2]], readers=2, lease_s=60)["tickets"]
    for rank in range(2):
        pool = Pool.empty(rank_heads(1, 2, rank), 16, "HND")
        decode = engine_with(cluster, b, f"d{rank}-mla2", pool, 1, 2, rank)
        [result] = decode("pull", pulls=[[ticket, [4, 5, 6]]])["results"]
        assert result["ok"] and result["transport"] != "shared", result
        for got, want in zip(pool_bytes(decode), pool.expected(logical, [4, 5, 6], pool.heads, TOKENS), strict=True):
            np.testing.assert_array_equal(got, want)
    assert prefill("released", offer_ids=[ticket["offer_id"]])["reasons"] == ["pulled"]
    assert len([t for t in _ctl(a, "transfers", "--all") if t["offer"] == ticket["offer_id"]]) == 2


def _ctl(daemon: Daemon, *args: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "kvxfer_client._ctl", "--socket", daemon.socket, *args, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _shared_read_failing(
    cluster: Cluster, faults: str, tag: str, decode_faults: str = ""
) -> tuple[list[dict[str, Any]], str]:
    """Four MLA readers behind daemon b of one offer on daemon a, which holds the first pull at
    ``after_accepted`` (3 s) until the others joined and then fails it as ``faults`` (a) and
    ``decode_faults`` (b) say: the pull results (the leader's first) and how the offer was
    released."""
    a = cluster.daemon("a", "--fault-injection", "--faults", "after_accepted=pause:3;" + faults)
    b = cluster.daemon("b", *(("--fault-injection", "--faults", decode_faults) if decode_faults else ()))
    src = Pool.empty(rank_heads(1, 1, 0), 16, "HND")
    src.fill(logical_kv(1, TOKENS, seed=13), [0, 1, 2])
    prefill = engine_with(cluster, a, f"p-{tag}", src, 1, 1, 0)
    [ticket] = prefill("offer", requests=[[0, 1, 2]], readers=4, lease_s=60)["tickets"]
    pools = [Pool.empty(rank_heads(1, 4, r), 16, "HND") for r in range(4)]
    decodes = [engine_with(cluster, b, f"d{r}-{tag}", pools[r], 1, 4, r) for r in range(4)]
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(decodes[0], "pull", pulls=[[ticket, [3, 4, 5]]])
        wait_for(lambda: "fault.hit" in a.log(), "the offerer to hold the first pull")
        rest = [pool.submit(decodes[r], "pull", pulls=[[ticket, [3, 4, 5]]]) for r in range(1, 4)]
        results = [f.result()["results"][0] for f in (first, *rest)]
    [reason] = prefill("released", offer_ids=[ticket["offer_id"]])["reasons"]
    return results, reason


def test_joiners_of_a_read_that_fails_before_its_bytes_land_pull_on_their_own(cluster: Cluster) -> None:
    """The shared read fails before any byte lands (a broken endpoint): the offerer releases
    the offer as failed, the joiners pull on their own and are told the offer is gone."""
    results, reason = _shared_read_failing(cluster, "endpoint_broken=fail:1", "mla-broken")
    assert results[0]["type"] == "UnavailableError", results[0]
    assert all(r["type"] == "NotFoundError" and "failed" in r["error"] for r in results[1:]), results
    assert reason == "failed"


def test_joiners_counted_in_a_read_that_then_fails_share_its_failure(cluster: Cluster) -> None:
    """Every byte landed, matched its checksums and was copied to the joiners, but the leader
    fails before it says done: the joiners were counted in it, so they fail with it, each with
    its own typed error naming the shared read. (A failure the offerer sends before done, with
    its sums, comes before any joiner is counted: see the test above.)"""
    results, reason = _shared_read_failing(cluster, "", "mla-late", decode_faults="before_done=fail:1")
    assert all(r["type"] == "UnavailableError" for r in results), results
    leaders = {r["error"].split("the shared read ")[1].split()[0] for r in results[1:]}
    assert len(leaders) == 1 and leaders.pop().startswith("xfer-"), results
    assert reason == "failed"
