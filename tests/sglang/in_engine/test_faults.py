"""kvxfer's SGLang backend when a node dies, and SGLang's internals it relies on (run in the
SGLang venv: ``make sglang-test``)."""

from __future__ import annotations

import inspect
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from bench.cluster import Cluster, Daemon, wait_for
from bench.sglang_rank import SglangRank, write_model

TIMEOUT_S = 8
#: A rank's session after one restart of its daemon.
BACK = {"connected": True, "reconnects": 1}


@pytest.fixture
def env_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own bounds on a request's bootstrap and transfer, short (the ranks inherit them)."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", str(TIMEOUT_S))
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", str(TIMEOUT_S))


def _ranks(model: str, prefill_daemon: Daemon, decode_daemon: Daemon) -> tuple[SglangRank, SglangRank]:
    """A prefill and a decode rank (TP 1), paired through a bootstrap port of their own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    return SglangRank("prefill", (1, 0), port, model, prefill_daemon), SglangRank(
        "decode", (1, 0), port, model, decode_daemon
    )


def test_a_prefill_daemon_killed_mid_transfer_fails_the_request_on_both_ranks_in_bounded_time(
    tmp_path: str, env_bounds: None
) -> None:
    """The prefill node's daemon dies after it accepted the decode daemon's pull of the push
    (held there by a fault point) and before a byte moved: the decode rank's request fails
    with the typed reason well before SGLang's own timeout, the prefill rank's fails too, and
    the decode daemon keeps no transfer, offer or mapping of it."""
    model = write_model(str(tmp_path))
    with Cluster() as cluster, ThreadPoolExecutor(2) as pool:
        a = cluster.daemon("prefill-node", "--fault-injection", "--faults", "after_accepted=pause:60")
        b = cluster.daemon("decode-node")
        prefill, decode = _ranks(model, a, b)
        try:
            room = 5 << 20
            prefill("sender", room=room)
            assert decode("receiver", room=room) == 2
            decode("allocate", room=room, tokens=200, prefix=0)
            wait_for(lambda: prefill("poll", rooms=[room])[str(room)] == 2, "the prefill side to be bootstrapped")
            prefill("prefill", room=room, tokens=200, chunk_pages=4)
            wait_for(lambda: "fault.hit" in a.log(), "the transfer to reach the fault point", 20)
            a.kill()
            started = time.monotonic()
            decode_end = pool.submit(decode, "wait", rooms=[room], timeout_s=TIMEOUT_S + 10)
            prefill_end = pool.submit(prefill, "wait", rooms=[room], timeout_s=TIMEOUT_S + 10)
            [d], [p] = decode_end.result().values(), prefill_end.result().values()
            assert d["status"] == "failed" and p["status"] == "failed", (d, p)
            assert time.monotonic() - started < TIMEOUT_S, "failed only by SGLang's own timeout"
            # Whichever came first: the decode daemon's typed error for its pull, or the
            # prefill rank's word that its daemon's session was lost.
            assert any(w in d["reason"] for w in ("UnavailableError", "session with kvxferd lost")), d
            assert "session with kvxferd lost" in p["reason"] or "UnavailableError" in p["reason"], p
            import asyncio

            status = asyncio.run(b.settled(10))
            assert (status.active_offers, status.active_transfers) == (0, 0), status
        finally:
            prefill.close()
            decode.close()


def _handoff(prefill: SglangRank, decode: SglangRank, room: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One request through both ranks, in SGLang's order; how each side ended."""
    prefill("sender", room=room)
    assert decode("receiver", room=room) == 2
    decode("allocate", room=room, tokens=90, prefix=0)
    wait_for(lambda: prefill("poll", rooms=[room])[str(room)] == 2, "the prefill side to be bootstrapped")
    prefill("prefill", room=room, tokens=90, chunk_pages=2)
    [p] = prefill("wait", rooms=[room], timeout_s=30).values()
    [d] = decode("wait", rooms=[room], timeout_s=30).values()
    return p, d


def _session(rank: SglangRank) -> dict[str, Any]:
    daemon = rank("state")["daemon"]
    return {"connected": daemon["connected"], "reconnects": daemon["reconnects"]}


def test_each_daemon_restarted_under_running_ranks_serves_the_next_requests(tmp_path: str, env_bounds: None) -> None:
    """The prefill node's daemon, then the decode node's, restarts (on a new peer port) while
    the SGLang ranks keep running: each rank's session comes back by itself with its pools
    registered again, and the next request hands off byte-exact, without restarting any rank
    (the decode rank names its daemon's new address in each request)."""
    model = write_model(str(tmp_path))
    with Cluster() as cluster:
        a, b = cluster.daemon("prefill-node"), cluster.daemon("decode-node")
        prefill, decode = _ranks(model, a, b)
        try:
            p, d = _handoff(prefill, decode, 6 << 20)
            assert p["status"] == d["status"] == "success" and d["bad_elements"] == 0, (p, d)
            for n, (daemon, rank) in enumerate(((a, prefill), (b, decode)), start=1):
                daemon.terminate()
                daemon.start()
                # The rank notices and reconnects on its own (requests meanwhile fail, saying why).
                wait_for(lambda r=rank: _session(r) == BACK, f"{rank.name} to reconnect", 30)
                p, d = _handoff(prefill, decode, (6 << 20) + n)
                assert p["status"] == d["status"] == "success", (daemon.name, p, d)
                assert d["bad_elements"] == 0 and d["metadata_ok"], d
        finally:
            prefill.close()
            decode.close()


def test_the_sglang_names_the_backend_relies_on_are_where_it_expects_them() -> None:
    """SGLang's internals this backend uses (not a promised API): a release that moves or
    renames one fails here, naming it, before any request would."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins

    from kvxfer_client.sglang import TESTED_SGLANG, check_version

    assert check_version() in TESTED_SGLANG
    assert GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    load_plugins()  # kvxfer's entry point, as SGLang's launcher runs it
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation.common import conn
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from kvxfer_client.sglang import _conn

    assert "kvxfer" in choices.DISAGG_TRANSFER_BACKEND_CHOICES
    backend = TransferBackend("kvxfer")
    assert TransferBackend("mooncake") == TransferBackend.MOONCAKE  # SGLang's own members still compare
    assert get_kv_class(backend, KVClassType.MANAGER) is _conn.KvxferKVManager
    assert get_kv_class(backend, KVClassType.RECEIVER) is _conn.KvxferKVReceiver
    assert get_kv_class(TransferBackend.NIXL, KVClassType.SENDER).__name__ == "NixlKVSender"
    expected = {
        conn.CommonKVManager: ["_make_worker_recv", "_start_heartbeat_checker_thread", "_room_notify_targets",
                               "send_kv_status_message", "parse_kv_status_message", "conclude_transfer",
                               "conclude_failure", "update_status", "record_failure", "check_status"],
        conn.CommonKVSender: ["send", "poll", "abort", "clear", "failure_exception", "pop_decode_prefix_len"],
        conn.CommonKVReceiver: ["init", "poll", "abort", "clear", "ensure_abort_notified", "_send_bootstrap_message",
                                "invalidate_cached_bootstrap_infos"],
    }  # fmt: skip
    for cls, names in expected.items():
        missing = [n for n in names if not callable(getattr(cls, n, None))]
        assert not missing, f"SGLang's {cls.__name__} no longer has {missing}"
    # The sender hands chunks to the manager's add_transfer_request with these arguments.
    send = inspect.getsource(conn.CommonKVSender.send)
    assert "self.kv_mgr.add_transfer_request(" in send and "aux_index=" in send and "state_indices=" in send
    send_metadata = inspect.signature(conn.CommonKVReceiver.send_metadata)
    assert list(send_metadata.parameters)[:5] == [
        "self",
        "kv_indices",
        "aux_index",
        "state_indices",
        "decode_prefix_len",
    ]
    # A hybrid model's state: the kinds moved row for row, and where SGLang declares them.
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType

    from kvxfer_client.sglang._state import ROW_KINDS

    missing_kinds = ROW_KINDS - {t.value for t in StateType}
    assert not missing_kinds, f"SGLang no longer has the state kinds {missing_kinds}"
    hints = KVArgs.__annotations__
    for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "swa_kv_cache_layout"):
        assert name in hints, f"SGLang's KVArgs no longer declares {name}"
