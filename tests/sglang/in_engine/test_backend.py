"""kvxfer as SGLang's transfer backend, against SGLang's own classes (run in the SGLang venv:
``make sglang-test``).

Each SGLang rank is a process of its own (``bench.sglang_rank``): SGLang's runtime context and
plugins, its CPU ``MHATokenToKVPool`` and ``MetadataBuffers``, its bootstrap server, and the
manager, senders and receivers ``get_kv_class`` returns for ``kvxfer``. The test drives them in
the order SGLang's queues do: the prefill bootstrap queue makes the sender and polls it to
``WaitingForInput``, then ``init`` and, after the forward pass, one ``send`` per chunk; the
decode prealloc queue makes the receiver, fetches the prefill's parallel info, ``init``s it,
allocates pages past the cached prefix and ``send_metadata``; both transfer queues poll to
the end, read ``failure_exception`` on a failure and ``clear``. The prefill daemon and the
decode daemon are separate kvxferd processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from bench.cluster import Cluster, Daemon
from bench.sglang_rank import SglangRank, write_model

WAITING_FOR_INPUT, FAILED = 2, 0
#: SGLang's own bounds on a request's bootstrap and transfer (seconds), short for the tests.
TIMEOUT_S = 8


@dataclass
class Pair:
    prefill: list[SglangRank]
    decode: list[SglangRank]
    prefill_daemon: Daemon
    decode_daemon: Daemon

    def all(self) -> list[SglangRank]:
        return [*self.prefill, *self.decode]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _ranks(prefill_tp: int, decode_tp: int, model: str, kind: str = "mha", decode_faults: str = "") -> Iterator[Pair]:
    """Prefill ranks on one daemon, decode ranks on another (with fault points
    ``decode_faults``), of a ``kind`` model."""
    os.environ["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = str(TIMEOUT_S)
    os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(TIMEOUT_S)
    with Cluster() as cluster, ThreadPoolExecutor(4) as pool:
        faults = ["--fault-injection", "--faults", decode_faults] if decode_faults else []
        a, b = cluster.daemon("prefill-node"), cluster.daemon("decode-node", *faults)
        port = _port()
        first = SglangRank("prefill", (prefill_tp, 0), port, model, a, kind)  # it runs the bootstrap server
        others = [
            pool.submit(SglangRank, "prefill", (prefill_tp, r), port, model, a, kind) for r in range(1, prefill_tp)
        ]
        decode = [pool.submit(SglangRank, "decode", (decode_tp, r), port, model, b, kind) for r in range(decode_tp)]
        p = Pair([first, *(f.result() for f in others)], [f.result() for f in decode], a, b)
        try:
            yield p
        finally:
            for rank in p.all():
                rank.close()


@pytest.fixture(scope="module", params=[(1, 1), (1, 2), (2, 1)], ids=lambda tp: f"tp{tp[0]}to{tp[1]}")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with _ranks(*request.param, write_model(str(tmp_path_factory.mktemp("model")))) as p:
        yield p


def _bootstrap(pair: Pair, rooms: list[int]) -> None:
    """Senders and receivers made, the receivers ``init``ed."""
    for room in rooms:
        for rank in pair.prefill:
            rank("sender", room=room)
        for rank in pair.decode:
            assert rank("receiver", room=room) == WAITING_FOR_INPUT


def _until_waiting_for_input(pair: Pair, rooms: list[int]) -> None:
    deadline = time.monotonic() + 20
    for rank in pair.prefill:
        while set(rank("poll", rooms=rooms).values()) != {WAITING_FOR_INPUT}:
            assert time.monotonic() < deadline, rank("poll", rooms=rooms)
            time.sleep(0.02)


def _wait(ranks: list[SglangRank], rooms: list[int], timeout_s: float = 30) -> list[dict[str, dict[str, object]]]:
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(lambda r: r("wait", rooms=rooms, timeout_s=timeout_s), ranks))


def _settled(daemon: Daemon) -> tuple[int, int]:
    status = asyncio.run(daemon.settled(10))
    return int(status.active_offers), int(status.active_transfers)


def _holds_nothing(pair: Pair) -> None:
    """Neither daemon keeps an offer or a transfer (within 10 s); where one does, the message
    carries what its log says of offers, pushes and transfers."""
    for daemon in (pair.prefill_daemon, pair.decode_daemon):
        held = _settled(daemon)
        if held != (0, 0):
            lines = [ln for ln in daemon.log().splitlines() if any(k in ln for k in ("offer.", "push.", "transfer."))]
            raise AssertionError(f"{daemon.name} holds (offers, transfers) {held}; its log:\n" + "\n".join(lines[-40:]))


def _rooms(base: int, n: int) -> list[int]:
    return [(base << 20) + i for i in range(n)]


def _succeeded(pair: Pair, shapes: dict[int, tuple[int, int]], chunk_pages: int) -> list[tuple[str, dict[str, Any]]]:
    """Requests (room: tokens, cached prefix) run at once the way SGLang's queues run them;
    each must succeed on every rank. Returns every decode rank's end of each (room, end)."""
    rooms = list(shapes)
    _bootstrap(pair, rooms)
    for room, (tokens, prefix) in shapes.items():
        for rank in pair.decode:
            rank("allocate", room=room, tokens=tokens, prefix=prefix)
    _until_waiting_for_input(pair, rooms)
    for room, (tokens, _) in shapes.items():
        for rank in pair.prefill:
            rank("prefill", room=room, tokens=tokens, chunk_pages=chunk_pages)
    for ends in _wait(pair.prefill, rooms):
        assert {e["status"] for e in ends.values()} == {"success"}, ends
    decode_ends = [item for ends in _wait(pair.decode, rooms) for item in ends.items()]
    assert all(end["status"] == "success" for _, end in decode_ends), decode_ends
    return decode_ends


def test_requests_at_once_land_byte_exact_in_the_decode_ranks_pages(pair: Pair) -> None:
    """Five requests in flight at once, of other lengths and cached prefixes, sent in chunks
    of three pages: each decode rank's pages hold exactly its heads of each token, and the
    metadata row (the first output token, the room) came along."""
    rooms = _rooms(1, 5)
    shapes = dict(zip(rooms, [(17, 0), (100, 0), (256, 32), (301, 64), (48, 16)], strict=True))
    for room, end in _succeeded(pair, shapes, chunk_pages=3):
        assert end["bad_elements"] == 0 and end["elements"] > 0 and end["metadata_ok"], (room, end)
    _holds_nothing(pair)
    # SGLang's own KV checksum is comparable only where both sides hold the same heads.
    same_heads = len(pair.prefill) == len(pair.decode)
    assert all(rank("compares_checksums") == same_heads for rank in pair.decode)


def test_each_chunk_moves_while_the_prefill_computes_the_next(pair: Pair) -> None:
    """SGLang's chunked prefill: the pages of the chunks sent so far land in every decode
    rank's pages before the prefill has sent its last chunk, so the transfer overlaps the
    prefill; once it has, the request ends byte-exact on both sides."""
    [room] = _rooms(8, 1)
    _bootstrap(pair, [room])
    for rank in pair.decode:
        rank("allocate", room=room, tokens=160, prefix=0)  # 10 pages
    _until_waiting_for_input(pair, [room])
    for rank in pair.prefill:
        rank("prefill", room=room, tokens=160, chunk_pages=2, chunks=2)  # pages 0-3 only, for now
    deadline = time.monotonic() + 20
    while (landed := [rank("landed_pages", room=room) for rank in pair.decode]) != [4] * len(pair.decode):
        assert time.monotonic() < deadline and max(landed) <= 4, landed
        time.sleep(0.05)
    assert all(rank("poll", rooms=[room])[str(room)] == WAITING_FOR_INPUT for rank in pair.decode)
    for rank in pair.prefill:
        rank("send_rest", room=room)
    assert all(e[str(room)]["status"] == "success" for e in _wait(pair.prefill, [room])), "prefill"
    for ends in _wait(pair.decode, [room]):
        assert ends[str(room)]["status"] == "success" and ends[str(room)]["bad_elements"] == 0, ends
    _holds_nothing(pair)


def test_a_chunk_message_under_another_nonce_is_ignored_and_one_out_of_order_fails_the_request(pair: Pair) -> None:
    """A decode rank expects a push only from a chunk message under the nonce it gave the
    prefill rank. One under a made-up nonce (pages 2-3) changes nothing; the prefill rank's own
    announcing pages 4-5 next is then out of order (had the forged one counted, it would not
    be): the request fails at once on the decode side, naming the positions, then on the
    prefill side, and neither daemon keeps anything."""
    [room] = _rooms(9, 1)
    _bootstrap(pair, [room])
    for rank in pair.decode:
        rank("allocate", room=room, tokens=96, prefix=0)  # 6 pages
    _until_waiting_for_input(pair, [room])
    for rank in pair.prefill:
        rank("prefill", room=room, tokens=96, chunk_pages=2, chunks=1)
        rank("forge_chunk", room=room, start=2, count=2, own_nonce=False)
        rank("forge_chunk", room=room, start=4, count=2, own_nonce=True)
    started = time.monotonic()
    for ends in _wait(pair.decode, [room], timeout_s=TIMEOUT_S):
        assert ends[str(room)]["status"] == "failed", ends
        assert "expected page 2 next" in str(ends[str(room)]["reason"]), ends
    assert time.monotonic() - started < TIMEOUT_S / 2
    assert all(e[str(room)]["status"] == "failed" for e in _wait(pair.prefill, [room], timeout_s=TIMEOUT_S))
    _holds_nothing(pair)


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_request_aborted_on_one_side_fails_the_other_at_once_and_leaves_nothing(pair: Pair, side: str) -> None:
    """SGLang aborts a request on one side once both are bootstrapped: the other side hears it
    over the control socket and fails well before SGLang's own timeout (from the prefill side,
    saying it aborted), and neither daemon keeps an offer or a transfer."""
    [room] = _rooms(2 if side == "decode" else 3, 1)
    _bootstrap(pair, [room])
    for rank in pair.decode:
        rank("allocate", room=room, tokens=64, prefix=0)
    _until_waiting_for_input(pair, [room])
    aborting, other = (pair.decode, pair.prefill) if side == "decode" else (pair.prefill, pair.decode)
    for rank in aborting:
        rank("abort", room=room)
    started = time.monotonic()
    ends = _wait(other, [room], timeout_s=TIMEOUT_S + 5)
    assert all(e[str(room)]["status"] == "failed" for e in ends), ends
    assert time.monotonic() - started < TIMEOUT_S, f"the other side heard of the {side} abort only by its timeout"
    if side == "prefill":
        assert all("aborted" in str(e[str(room)].get("reason")) for e in ends), ends
    assert all(e[str(room)]["status"] == "failed" for e in _wait(aborting, [room])), "the aborting side"
    _holds_nothing(pair)


def test_a_prefill_abort_while_the_decode_daemon_pulls_a_push_withdraws_its_offer(tmp_path: str) -> None:
    """The prefill side aborts a request while the decode daemon is pulling one of its pushes
    (held at ``before_done``, 6 s): an engine's release of an offer being pulled is refused,
    so what ends it is the prefill rank's cancel of the push's transfer, which fails the pull
    on both daemons. Its daemon holds nothing well before the pull would have ended (or the
    offer's 30 s lease), and the decode side fails the request."""
    [room] = _rooms(10, 1)
    with _ranks(1, 1, write_model(tmp_path), decode_faults="before_done=pause:6") as pair:
        _bootstrap(pair, [room])
        for rank in pair.decode:
            rank("allocate", room=room, tokens=96, prefix=0)  # 6 pages
        _until_waiting_for_input(pair, [room])
        for rank in pair.prefill:
            rank("prefill", room=room, tokens=96, chunk_pages=2, chunks=1)  # pages 0-1 pushed
        deadline = time.monotonic() + 20
        while "point=before_done" not in pair.decode_daemon.log():
            assert time.monotonic() < deadline, "the decode daemon never pulled the push"
            time.sleep(0.02)
        for rank in pair.prefill:
            rank("abort", room=room)
        started = time.monotonic()
        assert _settled(pair.prefill_daemon) == (0, 0)
        assert time.monotonic() - started < 5, "the offer waited for the pull to end"
        assert all(e[str(room)]["status"] == "failed" for e in _wait(pair.decode, [room], timeout_s=TIMEOUT_S))
        assert _settled(pair.decode_daemon) == (0, 0)


def test_a_bogus_bootstrap_room_fails_in_bounded_time_on_both_sides(pair: Pair) -> None:
    """A decode request whose room no prefill request has, and a prefill request no decode
    rank names: each fails by SGLang's bound, and neither daemon keeps anything."""
    decode_only, prefill_only = _rooms(4, 2)
    for rank in pair.decode:
        assert rank("receiver", room=decode_only) == WAITING_FOR_INPUT
        rank("allocate", room=decode_only, tokens=32, prefix=0)
    for rank in pair.prefill:
        rank("sender", room=prefill_only)
    started = time.monotonic()
    decode_ends, prefill_ends = _wait(pair.decode, [decode_only]), _wait(pair.prefill, [prefill_only])
    assert all(e[str(decode_only)]["status"] == "failed" for e in decode_ends), decode_ends
    assert all(e[str(prefill_only)]["status"] == "failed" for e in prefill_ends), prefill_ends
    assert time.monotonic() - started < 3 * TIMEOUT_S
    _holds_nothing(pair)
    assert all(decode_only not in r("state")["rooms"] for r in pair.all())


@pytest.mark.parametrize(
    ("kind", "prefill_tp", "decode_tp"),
    [("swa", 2, 1), ("mamba", 2, 2)],
    ids=["swa-tp2to1", "mamba-tp2to2"],
)
def test_a_hybrid_models_state_lands_byte_exact_beside_its_pages(
    tmp_path: str, kind: str, prefill_tp: int, decode_tp: int
) -> None:
    """SGLang's own hybrid pools (``bench.sglang_hybrid``): a sliding-window layer's pages
    (state ``swa``, head by head across TP) or a Mamba layer's conv and SSM rows (state
    ``mamba``, a slot per request) land byte-exact in the rows the decode side named, with
    the full-attention pages and the metadata row, for three requests at once."""
    rooms = _rooms(6, 3)
    shapes = dict(zip(rooms, [(40, 0), (130, 16), (97, 0)], strict=True))
    with _ranks(prefill_tp, decode_tp, write_model(tmp_path), kind) as pair:
        for room, end in _succeeded(pair, shapes, chunk_pages=2):
            assert end["bad_elements"] == 0 and end["metadata_ok"] and end["state_bad_elements"] == 0, (room, end)
        _holds_nothing(pair)


def test_mamba_state_between_other_tp_sizes_fails_at_once_naming_the_fix(tmp_path: str) -> None:
    """A Mamba layer's rows are a rank's shard: between TP 1 and TP 2 they cannot move row
    for row. The decode side fails the request when it names its rows (well before SGLang's
    timeout), saying to run equal TP sizes; the prefill side hears it; nothing stays held."""
    [room] = _rooms(7, 1)
    with _ranks(1, 2, write_model(tmp_path), "mamba") as pair:
        _bootstrap(pair, [room])
        started = time.monotonic()
        for rank in pair.decode:
            rank("allocate", room=room, tokens=64, prefix=0)
        for ends in _wait(pair.decode, [room], timeout_s=TIMEOUT_S):
            assert ends[str(room)]["status"] == "failed", ends
            assert "equal attention TP" in str(ends[str(room)]["reason"]), ends
        assert time.monotonic() - started < TIMEOUT_S / 2
        assert all(e[str(room)]["status"] == "failed" for e in _wait(pair.prefill, [room], timeout_s=3 * TIMEOUT_S))
        _holds_nothing(pair)
