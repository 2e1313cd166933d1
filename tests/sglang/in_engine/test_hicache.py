"""The node's KV tier as SGLang's HiCache storage, through SGLang's own classes (run in the
SGLang venv: ``make sglang-test``): each engine is a process with SGLang's host KV pool and
the backend SGLang's ``StorageBackendFactory`` loads by module path."""

from __future__ import annotations

import pytest

from bench.cluster import Cluster
from bench.sglang_hicache import SglangHiCache
from bench.sglang_rank import write_model

KEYS = [f"{i:064x}" for i in range(1, 7)]  # SGLang's page hashes are 64 hex digits


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_pages_stored_by_one_engine_load_byte_exact_in_another_and_salts_keep_tenants_apart(
    layout: str, tmp_path: str
) -> None:
    model = write_model(str(tmp_path))
    with Cluster() as cluster:
        node = cluster.daemon("node", "--tier-host-bytes", str(64 << 20))
        writer = SglangHiCache(layout, "tenant-a", model, node, "writer")
        reader = SglangHiCache(layout, "tenant-a", model, node, "reader")
        stranger = SglangHiCache(layout, "tenant-b", model, node, "stranger")
        try:
            assert reader("exists", keys=KEYS) == 0
            assert writer("store", keys=KEYS[:4], seed=7) == [True] * 4
            assert reader("exists", keys=KEYS) == 4, "the longest stored prefix"
            got = reader("load", keys=KEYS, seed=7)
            assert got["loaded"] == 4 and got["ok"] == [True] * 4 + [False] * 2 and got["bad_pages"] == [], got
            assert stranger("exists", keys=KEYS) == 0, "another tenant's salt sees nothing"
            assert stranger("load", keys=KEYS[:2], seed=7)["loaded"] == 0
        finally:
            for engine in (writer, reader, stranger):
                engine.close()


def test_an_engine_on_another_node_loads_the_pages_from_that_nodes_tier(tmp_path: str) -> None:
    """``from_peer``: the reader's daemon asks the writer's node for the pages and lands them
    in the reader's host pool over the data plane."""
    model = write_model(str(tmp_path))
    with Cluster() as cluster:
        first = cluster.daemon("node-a", "--tier-host-bytes", str(64 << 20))
        second = cluster.daemon("node-b", "--tier-host-bytes", str(64 << 20))
        writer = SglangHiCache("layer_first", "t", model, first, "writer")
        peer = str(first.info["peer_address"])
        reader = SglangHiCache("layer_first", "t", model, second, "reader", from_peer=peer)
        try:
            assert writer("store", keys=KEYS[:5], seed=11) == [True] * 5
            assert reader("exists", keys=KEYS) == 5
            got = reader("load", keys=KEYS[:5], seed=11)
            assert got["loaded"] == 5 and got["bad_pages"] == [], got
        finally:
            writer.close()
            reader.close()


def test_a_restarted_daemon_is_a_clean_miss_and_stores_again(tmp_path: str) -> None:
    model = write_model(str(tmp_path))
    with Cluster() as cluster:
        node = cluster.daemon("node", "--tier-host-bytes", str(64 << 20))
        engine = SglangHiCache("page_first", "", model, node, "engine")
        try:
            assert engine("store", keys=KEYS[:3], seed=3) == [True] * 3
            assert engine("exists", keys=KEYS[:3]) == 3
            node.terminate()
            assert engine("exists", keys=KEYS[:3]) == 0, "no daemon: a miss, not an error"
            assert engine("load", keys=KEYS[:3], seed=3)["loaded"] == 0
            node.start()
            deadline_misses = [engine("exists", keys=KEYS[:3]) for _ in range(3)]
            assert deadline_misses == [0, 0, 0], "the restarted daemon's tier is empty"
            assert engine("store", keys=KEYS[:3], seed=4) == [True] * 3, "the engine's pool was registered again"
            got = engine("load", keys=KEYS[:3], seed=4)
            assert got["loaded"] == 3 and got["bad_pages"] == [], got
        finally:
            engine.close()
