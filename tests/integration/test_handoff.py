"""Prefill→decode handoffs through real daemons and real engine processes, both paths."""

from __future__ import annotations

import numpy as np
import pytest

from bench.cluster import Cluster

PATHS = ["local", "remote"]


def engines(cluster: Cluster, path: str, shape: dict[str, int], seed: int, tag: str):  # type: ignore[no-untyped-def]
    a, b = cluster.daemons[0], cluster.daemons[1]
    prefill = cluster.engine(a, f"prefill-{tag}-{path}")
    decode = cluster.engine(a if path == "local" else b, f"decode-{tag}-{path}")
    prefill("pool", shape=shape, seed=seed)
    decode("pool", shape=shape)
    return prefill, decode


@pytest.mark.parametrize("path", PATHS)
def test_out_of_order_non_contiguous_blocks_arrive_byte_exact(two_daemons: Cluster, path: str) -> None:
    # 3000-byte segments: not a multiple of 8 or 16, so no copy may assume alignment.
    shape = {"layers": 4, "blocks": 64, "block_bytes": 3000}
    prefill, decode = engines(two_daemons, path, shape, seed=11, tag="exact")
    rng = np.random.default_rng(5)
    dst_all = rng.permutation(64)[:60]  # later pulls must not overwrite earlier destinations
    pairs = [(rng.permutation(64)[:20].tolist(), dst_all[i * 20 : i * 20 + 20].tolist()) for i in range(3)]
    tickets = prefill("offer", requests=[p[0] for p in pairs])["tickets"]
    for ticket, (_, dst) in zip(tickets, pairs, strict=True):
        result = decode("pull", pulls=[[ticket, dst]])["results"][0]
        assert result["ok"], result
        assert result["bytes"] == 20 * 4 * 2 * 3000
        assert result["path"] == path
        assert result["transport"] == ("local-copy" if path == "local" else "ucx:shm+cma")
    assert decode("verify", seed=11, pairs=pairs) == {"ok": True, "verified": True, "bad_bytes": 0}
    released = prefill("released", offer_ids=[t["offer_id"] for t in tickets])
    assert released["reasons"] == ["pulled"] * 3


@pytest.mark.parametrize("path", PATHS)
def test_blocks_larger_than_a_chunk_go_zero_copy_and_arrive_exact(two_daemons: Cluster, path: str) -> None:
    shape = {"layers": 1, "blocks": 4, "block_bytes": (9 << 20) + 4096}  # spans chunk boundaries
    prefill, decode = engines(two_daemons, path, shape, seed=3, tag="big")
    pairs = [([2, 3], [1, 0])]
    ticket = prefill("offer", requests=[pairs[0][0]])["tickets"][0]
    assert decode("pull", pulls=[[ticket, pairs[0][1]]])["results"][0]["ok"]
    assert decode("verify", seed=3, pairs=pairs)["verified"]


@pytest.mark.parametrize("path", PATHS)
def test_200_concurrent_handoffs_all_arrive_exact(two_daemons: Cluster, path: str) -> None:
    shape = {"layers": 2, "blocks": 1024, "block_bytes": 1024}
    prefill, decode = engines(two_daemons, path, shape, seed=21, tag="many")
    rng = np.random.default_rng(9)
    dst_all = rng.permutation(1024)[:800]  # distinct destinations: concurrent pulls never overlap
    pairs = [(rng.permutation(1024)[:4].tolist(), dst_all[i * 4 : i * 4 + 4].tolist()) for i in range(200)]
    tickets = prefill("offer", requests=[p[0] for p in pairs])["tickets"]
    reply = decode("pull", pulls=[[t, p[1]] for t, p in zip(tickets, pairs, strict=True)])
    failures = [r for r in reply["results"] if not r["ok"]]
    assert not failures, failures[:3]
    assert len({r["transfer_id"] for r in reply["results"]}) == 200
    assert decode("verify", seed=21, pairs=pairs)["verified"]
    assert prefill("released", offer_ids=[t["offer_id"] for t in tickets])["reasons"] == ["pulled"] * 200


def test_packing_and_unpacking_through_staging_instead_of_iov_is_byte_exact(cluster: Cluster) -> None:
    """With IOV sends and receives off, fragmented chunks are packed into staging on the
    prefill side and land in staging to be unpacked on the decode side."""
    cluster.daemon("a", "--no-ucx-iov-send", "--chunk-bytes", "65536", "--window", "3")
    cluster.daemon("b", "--no-ucx-iov-receive", "--chunk-bytes", "65536", "--window", "3")
    shape = {"layers": 3, "blocks": 48, "block_bytes": 5000}
    prefill, decode = engines(cluster, "remote", shape, seed=8, tag="staged")
    rng = np.random.default_rng(2)
    pairs = [(rng.permutation(48)[:30].tolist(), rng.permutation(48)[:30].tolist())]
    ticket = prefill("offer", requests=[pairs[0][0]])["tickets"][0]
    assert decode("pull", pulls=[[ticket, pairs[0][1]]])["results"][0]["ok"]
    assert decode("verify", seed=8, pairs=pairs)["verified"]
    assert "ucx_iov_send=False" in cluster.daemons[0].log()
    assert "ucx_iov_receive=False" in cluster.daemons[1].log()


def test_a_prefill_daemon_restarted_on_the_same_address_is_greeted_again(cluster: Cluster) -> None:
    """The decode daemon's cached Hello and endpoint must not outlive the daemon they named."""
    a = cluster.daemon("a")
    cluster.daemon("b")
    shape = {"layers": 1, "blocks": 8, "block_bytes": 8192}
    prefill, decode = engines(cluster, "remote", shape, seed=2, tag="before")
    tickets = prefill("offer", requests=[[1], [3], [4]])["tickets"]
    assert all(r["ok"] for r in decode("pull", pulls=[[tickets[0], [2]], [tickets[1], [5]]])["results"])
    assert decode("pull", pulls=[[tickets[2], [7]]])["results"][0]["ok"]
    b = cluster.daemons[1]
    # Every pull from a peer rides one long-lived transfer stream (peer.proto, Transfers).
    assert b.log().count("peer.transfer_stream_opened") == 1, b.log()

    prefill.kill()
    a.kill()
    restarted = cluster.daemon("a2", "--peer-listen", a.info["peer_address"])
    assert restarted.info["peer_address"] == a.info["peer_address"]
    prefill2 = cluster.engine(restarted, "prefill-after")
    prefill2("pool", shape=shape, seed=3)
    ticket2 = prefill2("offer", requests=[[5]])["tickets"][0]
    result = decode("pull", pulls=[[ticket2, [6]]])["results"][0]
    assert result["ok"], result
    assert decode("verify", seed=3, pairs=[[[5], [6]]])["verified"]
    assert b.log().count("peer.transfer_stream_opened") == 2, "the restarted daemon needs a stream of its own"


@pytest.mark.parametrize("single_pass", [True, False], ids=["kernel-single-pass", "numpy-two-pass"])
def test_a_local_handoff_split_over_copy_threads_is_byte_exact(cluster: Cluster, single_pass: bool) -> None:
    """Many small chunks dealt to three copy threads; with the kernel's one-pass copy and
    with numpy's gather and scatter through scratch."""
    mode = "--local-single-pass" if single_pass else "--no-local-single-pass"
    daemon = cluster.daemon("a", mode, "--local-chunk-bytes", "65536", "--copy-threads", "3")
    shape = {"layers": 3, "blocks": 96, "block_bytes": 5000}  # 30 KB per block: ~50 chunks
    prefill = cluster.engine(daemon, "prefill-split")
    decode = cluster.engine(daemon, "decode-split")
    prefill("pool", shape=shape, seed=4)
    decode("pool", shape=shape)
    rng = np.random.default_rng(6)
    pairs = [(rng.permutation(96)[:90].tolist(), rng.permutation(96)[:90].tolist())]
    ticket = prefill("offer", requests=[pairs[0][0]])["tickets"][0]
    result = decode("pull", pulls=[[ticket, pairs[0][1]]])["results"][0]
    assert result["ok"] and result["path"] == "local", result
    assert decode("verify", seed=4, pairs=pairs) == {"ok": True, "verified": True, "bad_bytes": 0}
    assert f"local_single_pass={single_pass}" in daemon.log()
