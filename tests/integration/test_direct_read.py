"""Same-host direct reads: the decode daemon copies the offered blocks out of the offering
daemon's memory itself, after a probe proved it may; everything else about a pull stays."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.cluster import Cluster, Daemon, wait_for
from bench.heads import Pool, engine_with, logical_kv, pool_bytes
from kvxfer.geometry import rank_heads

TOKENS = 45
ON = {"KVXFERD_SAME_HOST_DIRECT_READ": "true"}
SHAPE = {"layers": 4, "blocks": 64, "block_bytes": 32 << 10}


def _pair(cluster: Cluster, prefill_env: dict[str, str], tag: str) -> tuple[Daemon, Daemon]:
    return cluster.daemon(f"{tag}-a", env=prefill_env), cluster.daemon(f"{tag}-b", env=ON)


def test_a_same_host_pull_reads_the_offer_directly_and_byte_exact(cluster: Cluster) -> None:
    a, b = _pair(cluster, ON, "direct")
    prefill, decode = cluster.engine(a, "p"), cluster.engine(b, "d")
    prefill("pool", shape=SHAPE, seed=5)
    decode("pool", shape=SHAPE)
    rng = np.random.default_rng(1)
    for _ in range(3):  # the first pull probes, the later ones reuse what it found
        src, dst = rng.permutation(64)[:20].tolist(), rng.permutation(64)[:20].tolist()
        [ticket] = prefill("offer", requests=[src])["tickets"]
        [result] = decode("pull", pulls=[[ticket, dst]])["results"]
        assert result["ok"] and result["transport"] == "direct:cma" and result["path"] == "remote", result
        assert result["bytes"] == 20 * 4 * 2 * (32 << 10)
        assert decode("verify", seed=5, pairs=[[src, dst]])["verified"]
        assert prefill("released", offer_ids=[ticket["offer_id"]])["reasons"] == ["pulled"]
    assert b.log().count("direct_read.on") == 1


def test_a_remapped_pull_reads_directly_too(cluster: Cluster) -> None:
    """Prefill TP 1 (8 heads, tokens-major) to decode rank 1 of TP 2 (heads-major, blocks of
    32): the reader plans the offering daemon's side of the remapped stream itself."""
    a, b = _pair(cluster, ON, "remap")
    logical = logical_kv(8, TOKENS, seed=9)
    src = Pool.empty(rank_heads(8, 1, 0), 16, "NHD")
    src.fill(logical, [3, 1, 7])
    prefill = engine_with(cluster, a, "p-remap", src, 8, 1, 0)
    [ticket] = prefill("offer", requests=[[3, 1, 7]], readers=2, lease_s=30)["tickets"]
    dst = Pool.empty(rank_heads(8, 2, 1), 32, "HND")
    decode = engine_with(cluster, b, "d-remap", dst, 8, 2, 1)
    [result] = decode("pull", pulls=[[ticket, [5, 2]]])["results"]
    assert result["ok"] and result["transport"] == "direct:cma", result
    assert result["mapping"] == "TP 1->2 (heads 4..7), NHD->HND, block 16->32 tokens"
    for got, want in zip(pool_bytes(decode), dst.expected(logical, [5, 2], dst.heads, TOKENS), strict=True):
        np.testing.assert_array_equal(got, want)


def test_an_offering_daemon_with_direct_reads_off_is_pulled_from_over_ucx(cluster: Cluster) -> None:
    a, b = _pair(cluster, {"KVXFERD_SAME_HOST_DIRECT_READ": "false"}, "off")
    prefill, decode = cluster.engine(a, "p"), cluster.engine(b, "d")
    prefill("pool", shape=SHAPE, seed=6)
    decode("pool", shape=SHAPE)
    [ticket] = prefill("offer", requests=[[1, 2, 3]])["tickets"]
    [result] = decode("pull", pulls=[[ticket, [4, 5, 6]]])["results"]
    assert result["ok"] and result["transport"].startswith("ucx:"), result
    assert decode("verify", seed=6, pairs=[[[1, 2, 3], [4, 5, 6]]])["verified"]
    assert "direct reads are off on this daemon" in b.log()


def test_a_pull_whose_offering_daemon_dies_meanwhile_fails_typed(cluster: Cluster) -> None:
    """The offering daemon is killed while it holds the pull after accepted: the reader's
    copy (or its wait for the peer) fails as UnavailableError, never a crash."""
    a = cluster.daemon("dead-a", "--fault-injection", "--faults", "after_accepted=pause:30", env=ON)
    b = cluster.daemon("dead-b", "--peer-timeout-s", "2", env=ON)
    prefill, decode = cluster.engine(a, "p"), cluster.engine(b, "d")
    prefill("pool", shape=SHAPE, seed=7)
    decode("pool", shape=SHAPE)
    [ticket] = prefill("offer", requests=[list(range(32))])["tickets"]
    with ThreadPoolExecutor(1) as pool:
        pulling = pool.submit(decode, "pull", pulls=[[ticket, list(range(32, 64))]], timeout_s=20)
        wait_for(lambda: "fault.hit" in a.log(), "the offering daemon to hold the pull")
        a.kill()
        [result] = pulling.result()["results"]
    assert not result["ok"] and result["type"] == "UnavailableError", result
    assert b.proc is not None and b.proc.poll() is None  # the reader lives on
