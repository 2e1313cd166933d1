"""The daemon's tables and its handoff rooms, in-process: real pools mapped from real shared
memory (through descriptors, as the daemon maps them), real copy threads, a real UCX worker;
no gRPC. The offering side's Transfer stream is a recording double (the peer's end, not what
is under test)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvxfer.proto import common_pb2, peer_pb2
from kvxfer.version import PROTOCOL_VERSION
from kvxfer_client import (
    CancelledError,
    DataLossError,
    HostBuffer,
    IncompatibleError,
    InvalidRequestError,
    Layout,
    NotFoundError,
    PermissionDeniedError,
)
from kvxferd import _digest, _offer_digest
from kvxferd._asks import PullAsk
from kvxferd._config import Settings
from kvxferd._faults import Faults
from kvxferd._integrity import Integrity
from kvxferd._offers import Offer, OfferTable
from kvxferd._services import Services
from kvxferd._sessions import Session, SessionTable
from kvxferd._transfers import TransferRecord, TransferTable
from kvxferd.dataplane.gpucopy import GpuDevices
from kvxferd.dataplane.plan import build_plan
from kvxferd.dataplane.staging import StagingPool
from kvxferd.handoff.local import LocalHandoff
from kvxferd.handoff.pull import Pulls
from kvxferd.handoff.serve import TransferServer
from kvxferd.memory.pools import Pool, PoolRegistry
from kvxferd.peer.directory import PeerDirectory
from kvxferd.peer.serve_request import ServeRequest
from kvxferd.transports.plane import RemotePlane

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=64, block_bytes=8192)
REASONS = {v: k for k, v in common_pb2.ReleaseReason.items()}


class Daemonless:
    """The pieces of a daemon the local path needs, wired as the node wires them."""

    def __init__(self) -> None:
        self.released: list[tuple[str, str, str]] = []
        self.observed: list[tuple[str, str, str, int]] = []
        self.sessions = SessionTable()
        self.pools = PoolRegistry()
        self.offers = OfferTable(100, self._released)
        self.transfers = TransferTable(16, lambda e: self.observed.append((e.path, e.transport, e.result, e.nbytes)))
        self.executor = ThreadPoolExecutor(2)
        settings = Settings(local_chunk_bytes=64 << 10, copy_threads=2)
        integrity = Integrity(settings, self.executor, Faults())
        services = Services(settings, self.executor, self._no_gpu, Faults(), integrity)
        local = LocalHandoff(services, self.offers, single_pass=True)
        self.pulls = Pulls("here", self.transfers, local, None)

    @staticmethod
    def _no_gpu() -> GpuDevices:
        raise AssertionError("host pools never ask for a GPU")

    def _released(self, offer: Offer, reason: Any, detail: str, transfer_id: str) -> None:
        self.released.append((offer.offer_id, REASONS[reason], transfer_id))

    def pool(self, session: Session, seed: int | None = None) -> tuple[Pool, list[HostBuffer]]:
        buffers = [HostBuffer.create(size) for size in LAYOUT.buffer_sizes()]
        if seed is not None:
            for i, buf in enumerate(buffers):
                buf.array()[:] = np.random.default_rng(seed + i).integers(0, 256, buf.size, dtype=np.uint8)
        handles = session.deposit_fds([os.dup(b.fd) for b in buffers])
        specs = [
            common_pb2.BufferSpec(kind=common_pb2.MEMORY_KIND_HOST_SHM, size=b.size, fd_handle=h)
            for b, h in zip(buffers, handles, strict=True)
        ]
        pool = self.pools.register(session, specs, LAYOUT.to_proto(), "")
        session.pools.add(pool.pool_id)
        return pool, buffers

    def ticket_for(self, offer: Offer) -> Any:
        from kvxfer.ticket import Ticket

        return Ticket(
            "here",
            "127.0.0.1:1",
            offer.offer_id,
            offer.token,
            len(offer.block_ids),
            offer.pool.fingerprint,
            offer.nbytes,
        )


@pytest.fixture
def d() -> Iterator[Daemonless]:
    daemon = Daemonless()
    yield daemon
    daemon.executor.shutdown()


def _blocks(buffers: list[HostBuffer], ids: list[int]) -> list[bytes]:
    arrays = [b.array() for b in buffers]
    return [
        arrays[r.buffer_index][r.offset + i * r.block_stride :][: r.block_bytes].tobytes()
        for r in LAYOUT.regions
        for i in ids
    ]


async def test_a_local_pull_copies_the_blocks_records_the_transfer_and_releases_the_offer(d: Daemonless) -> None:
    p, q = d.sessions.open("p"), d.sessions.open("q")
    src, src_bufs = d.pool(p, seed=1)
    dst, dst_bufs = d.pool(q)
    offer = d.offers.create(src, np.array([3, 9, 40], dtype=np.int64), 30.0)
    ask = PullAsk("s", dst.pool_id, d.ticket_for(offer), np.array([0, 63, 7], dtype=np.int64), 10.0, "t-1")
    record = await d.pulls.run_pull(ask, dst, np.asarray(ask.block_ids))
    assert _blocks(dst_bufs, [0, 63, 7]) == _blocks(src_bufs, [3, 9, 40])
    assert record.state == common_pb2.TRANSFER_STATE_SUCCEEDED and record.transport == "local-copy"
    assert d.released == [(offer.offer_id, "RELEASE_REASON_PULLED", "t-1")]
    assert not d.observed  # the metrics follow once the engine's answer is on its way
    await asyncio.sleep(0)
    assert d.observed == [("local", "local-copy", "succeeded", 3 * LAYOUT.bytes_per_block)]
    assert not d.offers.offers and not d.transfers.active
    # Retried under its id, the pull answers from the record and moves nothing.
    again = await d.pulls.run_pull(ask, dst, np.asarray(ask.block_ids))
    assert again is record and len(d.observed) == 1


async def test_a_small_local_pull_is_summed_as_it_lands_and_a_block_written_again_is_named(d: Daemonless) -> None:
    """A few blocks (2 x 4 segments, all in the default 8 samples) copied one assignment per segment are
    summed where they landed, without the general check; a block the engine wrote again after
    the offer fails the pull, named by the general check the mismatch hands over to."""
    p, q = d.sessions.open("p"), d.sessions.open("q")
    src, src_bufs = d.pool(p, seed=1)
    dst, _ = d.pool(q)
    integrity = d.pulls.local.integrity
    general: list[str] = []
    check_local = integrity.check_local

    async def spied(record: TransferRecord, *args: Any) -> None:
        general.append(record.transfer_id)
        await check_local(record, *args)

    integrity.check_local = spied  # type: ignore[method-assign]
    for transfer_id in ("t-ok", "t-rewritten"):
        offer = d.offers.create(src, np.array([3, 9], dtype=np.int64), 30.0)
        integrity.take_digest(offer)
        # Summed before the offer call answers: the engine's rewrite below comes after it.
        assert offer.digest is not None and offer.digest.done()
        if transfer_id == "t-rewritten":
            region = LAYOUT.regions[3]
            start = region.offset + 9 * region.block_stride
            src_bufs[region.buffer_index].array()[start : start + 8] ^= 0xFF  # another request's KV
        ask = PullAsk("s", dst.pool_id, d.ticket_for(offer), np.array([0, 63], dtype=np.int64), 10.0, transfer_id)
        if transfer_id == "t-ok":
            record = await d.pulls.run_pull(ask, dst, np.asarray(ask.block_ids))
            assert (record.integrity_mode, record.integrity_blocks, record.integrity_result) == ("sampled", 2, "ok")
            assert general == []
        else:
            with pytest.raises(DataLossError, match=r"blocks \[9\] changed after they were offered"):
                await d.pulls.run_pull(ask, dst, np.asarray(ask.block_ids))
            assert general == ["t-rewritten"]


async def test_a_pull_that_comes_before_a_large_offer_is_summed_awaits_the_sums(
    d: Daemonless, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large offer is summed in a copy thread while its answer goes out: a pull already
    running then (a ticket handed out before the offer) checks against those sums."""
    monkeypatch.setattr(_offer_digest, "INLINE_BYTES", 0)  # these few windows count as large
    monkeypatch.setattr(_digest, "INLINE_BYTES", 0)
    p, q = d.sessions.open("p"), d.sessions.open("q")
    src, src_bufs = d.pool(p, seed=1)
    dst, dst_bufs = d.pool(q)
    offer = d.offers.create(src, np.array([5, 6, 7, 8], dtype=np.int64), 30.0)
    d.pulls.local.integrity.take_digest(offer)
    assert offer.digest is not None and not offer.digest.done()
    ask = PullAsk("s", dst.pool_id, d.ticket_for(offer), np.array([1, 2, 3, 4], dtype=np.int64), 10.0, "t-early")
    record = await d.pulls.run_pull(ask, dst, np.asarray(ask.block_ids))
    assert (record.integrity_mode, record.integrity_result) == ("sampled", "ok")
    assert _blocks(dst_bufs, [1, 2, 3, 4]) == _blocks(src_bufs, [5, 6, 7, 8])


async def test_a_whole_pull_of_a_summed_offer_is_sent_the_sums_the_general_path_sends_built_once(
    d: Daemonless,
) -> None:
    """The offering side's lean step (a pull of every block of an offer already summed) sends
    what the general step sends for the same blocks, and builds it once for all readers."""
    p = d.sessions.open("p")
    src, _ = d.pool(p, seed=1)
    integrity = d.pulls.local.integrity
    offer = d.offers.create(src, np.array([3, 9], dtype=np.int64), 30.0, readers=2)
    integrity.take_digest(offer)

    def record(transfer_id: str) -> TransferRecord:
        return TransferRecord(transfer_id, "prefill", common_pb2.TRANSFER_PATH_REMOTE, offer.offer_id)

    lean, again, general = record("t-lean"), record("t-again"), record("t-general")
    sent = await integrity.to_send(lean, offer, None, None)
    assert await integrity.to_send(again, offer, None, None) is sent
    # The same blocks named one by one take the general step.
    expected = await integrity.to_send(general, offer, np.array([0, 1], dtype=np.int64), None)
    assert sent is not None and expected is not None and sent is not expected
    assert sent == expected and len(sent.sums) == 2 * len(LAYOUT.regions)
    facts = [(r.integrity_mode, r.integrity_blocks, r.integrity_result) for r in (lean, again, general)]
    assert facts == [("sampled", 2, "sent")] * 3


WINDOWED = peer_pb2.BlockSums(mode="full", window_bytes=4096, windows=[0], sums=[1])


def _window(starts: list[int], lengths: list[int], regions: list[int] | None = None) -> peer_pb2.BlockSums:
    """Sampled sums of one window of block position 2's first segment."""
    regions = [0] if regions is None else regions
    return peer_pb2.BlockSums(mode="sampled", positions=[2], sums=[1], regions=regions, starts=starts, lengths=lengths)


@pytest.mark.parametrize(
    ("sums", "remapped", "error"),
    [
        (peer_pb2.BlockSums(mode="full", positions=[0, 9], sums=[1, 2]), False, "outside this transfer"),  # 9 of 3
        (peer_pb2.BlockSums(mode="full", positions=[0, 1], sums=[1]), False, "outside this transfer"),  # counts differ
        (peer_pb2.BlockSums(mode="sampled", positions=[0], sums=[1], regions=[99]), False, "outside this transfer"),
        (peer_pb2.BlockSums(mode="full", positions=[2], sums=[12345]), False, "landed with other bytes"),
        # Sampled windows lie inside their segment, and are not empty.
        (_window(starts=[1 << 40], lengths=[8]), False, "outside this transfer"),
        (_window(starts=[0], lengths=[(1 << 64) - 1]), False, "outside this transfer"),
        (_window(starts=[0], lengths=[0]), False, "outside this transfer"),
        (_window(starts=[0, 8], lengths=[8]), False, "outside this transfer"),
        (_window(starts=[8], lengths=[8], regions=[]), False, "outside this transfer"),
        (_window(starts=[8], lengths=[8]), False, "landed with other bytes"),
        # A remapped stream is summed by windows, and only it.
        (peer_pb2.BlockSums(mode="full", positions=[0], sums=[1]), True, "do not fit this stream"),
        (WINDOWED, False, "do not fit this stream"),
        (peer_pb2.BlockSums(mode="full", window_bytes=4, windows=[0], sums=[1]), True, "outside this stream"),
        (peer_pb2.BlockSums(mode="full", window_bytes=1 << 40, windows=[0], sums=[1]), True, "outside this stream"),
        (peer_pb2.BlockSums(mode="full", window_bytes=4096, windows=[99], sums=[1]), True, "outside this stream"),
        (peer_pb2.BlockSums(mode="full", window_bytes=4096, windows=[0, 1], sums=[1]), True, "outside this stream"),
        (WINDOWED, True, "landed with other bytes"),
    ],
)
async def test_block_sums_a_peer_sends_are_checked_before_they_are_used(
    d: Daemonless, sums: peer_pb2.BlockSums, remapped: bool, error: str
) -> None:
    """A peer's sums name positions and regions (or windows of a remapped stream) of this
    transfer only (typed refusal, never an index error), and a wrong sum is a DataLossError
    naming the blocks."""
    dst, _ = d.pool(d.sessions.open("q"), seed=4)
    ids = np.array([5, 6, 7], dtype=np.int64)
    plan = build_plan(dst.regions, ids, 1 << 20) if remapped else None  # this side's plan of the stream
    integrity = Integrity(Settings(), d.executor, Faults())
    record = TransferRecord("t-sums", "decode", common_pb2.TRANSFER_PATH_REMOTE, "off-x")
    with pytest.raises((InvalidRequestError, DataLossError), match=error) as failed:
        await integrity.check_landed(record, sums, dst, ids, plan)
    if isinstance(failed.value, DataLossError):
        named = "(bytes [0] onwards, 4096 each" if remapped else "blocks [7] (positions [2]"
        assert named in str(failed.value) and record.integrity_result == "mismatch"


async def test_a_pool_in_use_is_unmapped_only_when_its_last_transfer_ends(d: Daemonless) -> None:
    pool, _ = d.pool(d.sessions.open("p"))
    with pool.in_use():
        pool.close_when_idle()
        assert pool.arrays, "unmapped while a transfer used it"
    assert not pool.arrays


async def test_the_offer_table_releases_once_whatever_ends_an_offer(d: Daemonless) -> None:
    owner, other = d.sessions.open("p"), d.sessions.open("q")
    pool, _ = d.pool(owner)
    ids = np.array([1], dtype=np.int64)
    kept, pulled, expiring = (d.offers.create(pool, ids, lease) for lease in (30.0, 30.0, 0.01))
    with pytest.raises(PermissionDeniedError):
        d.offers.release_unpulled(kept.offer_id, common_pb2.RELEASE_REASON_CANCELLED, "x", owner=other.session_id)
    d.offers.claim(pulled.offer_id, pulled.token)
    with pytest.raises(IncompatibleError):  # being pulled: cancel the transfer instead
        d.offers.release_unpulled(pulled.offer_id, common_pb2.RELEASE_REASON_CANCELLED, "x", owner=owner.session_id)
    await asyncio.sleep(0.05)
    assert d.offers.expiries == 1
    d.offers.release(pulled, common_pb2.RELEASE_REASON_PULLED)
    d.offers.release(pulled, common_pb2.RELEASE_REASON_FAILED)  # ended already: nothing
    assert d.offers.release_all(common_pb2.RELEASE_REASON_SHUTDOWN, "bye") == 1
    reasons = {offer_id: reason for offer_id, reason, _ in d.released}
    assert reasons == {
        expiring.offer_id: "RELEASE_REASON_EXPIRED",
        pulled.offer_id: "RELEASE_REASON_PULLED",
        kept.offer_id: "RELEASE_REASON_SHUTDOWN",
    }
    assert len(d.released) == 3 and not pool.offers
    with pytest.raises(NotFoundError):
        d.offers.release_unpulled(kept.offer_id, common_pb2.RELEASE_REASON_CANCELLED, "x")


async def test_the_transfer_table_cancels_waits_and_leaves_committed_transfers_alone(d: Daemonless) -> None:
    started = asyncio.Event()

    async def transfer(tid: str, committed: bool) -> TransferRecord:
        record = d.transfers.begin(TransferRecord(tid, "decode", common_pb2.TRANSFER_PATH_LOCAL, "off"))
        record.committed = committed
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            d.transfers.end(record, common_pb2.TRANSFER_STATE_CANCELLED, record.abort_detail)
            raise CancelledError(record.abort_detail) from None
        return record

    running = asyncio.create_task(transfer("t-run", committed=False))
    finishing = asyncio.create_task(transfer("t-commit", committed=True))
    await started.wait()
    await asyncio.sleep(0)
    assert [r.transfer_id for r in d.transfers.find("t-commit")] == []  # not cancellable
    stuck = await d.transfers.cancel(d.transfers.find("t-run"), "cancelled by a test", timeout_s=5)
    assert not stuck
    with pytest.raises(CancelledError, match="cancelled by a test"):
        await running
    assert not await d.transfers.wait_idle(0.05)  # the committed one still runs
    d.transfers.abort_all("shutting down")  # leaves it alone too
    await asyncio.sleep(0)
    assert not finishing.done()
    finishing.cancel()
    with pytest.raises(CancelledError):
        await finishing
    assert await d.transfers.wait_idle(1.0)
    assert [o[2] for o in d.observed] == ["cancelled", "cancelled"]


# -- the offering side (handoff/serve.py) ---------------------------------------------------


class RecordingStream:
    """The puller's end as the offering side sees it; records what the side wrote."""

    def __init__(self, gone: bool = False) -> None:
        self.gone = gone
        self.written: list[str] = []

    def puller_gone(self) -> bool:
        return self.gone

    def on_puller_gone(self, callback: Callable[[], None]) -> None:
        pass

    def time_remaining(self) -> float | None:
        return None

    async def send_headers(self) -> None:
        self.written.append("headers")

    async def accepted(self, accepted: Any) -> None:
        self.written.append("accepted")

    async def ready(self, layers: int) -> None:
        self.written.append(f"ready {layers}")

    async def sent(self, nbytes: int, transport: str, sums: Any = None) -> None:
        self.written.append("sent")

    async def read_done(self) -> tuple[bool, str] | None:
        return None

    async def closed(self) -> None:
        self.written.append("closed")


class Offerer:
    def __init__(self) -> None:
        from kvxferd.dataplane.ucx import UcxTransport

        self.d = Daemonless()
        self.settings = Settings()
        self.ucx = UcxTransport()
        me = peer_pb2.PeerIdentity(
            daemon_id="offerer", protocol_version=PROTOCOL_VERSION, ucx_worker_address=self.ucx.worker_address
        )
        self.peers = PeerDirectory(me, 5.0)
        self.peers.accept_hello(
            peer_pb2.PeerIdentity(
                daemon_id="puller", protocol_version=PROTOCOL_VERSION, ucx_worker_address=self.ucx.worker_address
            )
        )
        staging = StagingPool(1 << 20, 1 << 20)
        integrity = Integrity(self.settings, self.d.executor, Faults())
        services = Services(self.settings, self.d.executor, self.d._no_gpu, Faults(), integrity)
        plane = RemotePlane(services, self.ucx, self.peers, (staging, staging))
        self.offers: OfferTable = self.d.offers
        self.transfers: TransferTable = self.d.transfers
        self.server = TransferServer(services, plane, self.offers, self.transfers)
        self.sessions: SessionTable = self.d.sessions

    def request(self, offer: Any, **changes: Any) -> ServeRequest:
        fields: dict[str, Any] = {
            "transfer_id": "t-1",
            "offer_id": offer.offer_id,
            "token": offer.token,
            "receiver_daemon_id": "puller",
            "receiver_signature": LAYOUT.signature(),
            "num_blocks": len(offer.block_ids),
            "tag_base": 1 << 24,
            "chunk_bytes": 1 << 20,
            "timeout_s": 10.0,
            "deadline_s": 15.0,
        }
        fields.update(changes)
        return ServeRequest(**fields)


@pytest.fixture
async def offerer() -> AsyncIterator[Offerer]:
    pytest.importorskip("ucxx")
    o = Offerer()
    yield o
    await o.ucx.close()
    o.d.executor.shutdown()


async def test_a_wrong_token_claims_nothing_and_records_no_transfer(offerer: Offerer) -> None:
    pool, _ = offerer.d.pool(offerer.sessions.open("p"))
    offer = offerer.offers.create(pool, np.array([1, 2], dtype=np.int64), 30.0)
    with pytest.raises(PermissionDeniedError):
        await offerer.server.serve(offerer.request(offer, token=b"\x00" * 16), RecordingStream())
    assert offer.state == "offered" and not offerer.transfers.active and not offerer.d.released


async def test_a_puller_gone_before_the_claim_leaves_the_offer_pullable(offerer: Offerer) -> None:
    pool, _ = offerer.d.pool(offerer.sessions.open("p"))
    offer = offerer.offers.create(pool, np.array([1, 2], dtype=np.int64), 30.0)
    with pytest.raises(Exception, match="left before the offer was claimed"):
        await offerer.server.serve(offerer.request(offer), RecordingStream(gone=True))
    assert offer.state == "offered" and offer.offer_id in offerer.offers.offers


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"num_blocks": 3}, InvalidRequestError),
        ({"receiver_signature": common_pb2.LayoutSignature(block_bytes=[4096])}, IncompatibleError),
    ],
)
async def test_a_start_that_does_not_fit_the_offer_unclaims_it(
    offerer: Offerer, changes: dict[str, Any], error: type[Exception]
) -> None:
    pool, _ = offerer.d.pool(offerer.sessions.open("p"))
    offer = offerer.offers.create(pool, np.array([1, 2], dtype=np.int64), 30.0)
    stream = RecordingStream()
    with pytest.raises(error):
        await offerer.server.serve(offerer.request(offer, **changes), stream)
    assert offer.state == "offered" and not offerer.transfers.active
    assert stream.written == ["headers"]
    await asyncio.sleep(0)


async def test_a_puller_that_never_confirms_fails_the_transfer_and_releases_the_offer(offerer: Offerer) -> None:
    # Every chunk goes out over a real endpoint (to this process's own worker); the double
    # then ends the stream without done: the offer goes as failed, never as pulled.
    pool, bufs = offerer.d.pool(offerer.sessions.open("p"), seed=4)
    offer = offerer.offers.create(pool, np.array([1, 2], dtype=np.int64), 30.0)
    sink = np.zeros(2 * LAYOUT.bytes_per_block, dtype=np.uint8)
    receiving = asyncio.ensure_future(offerer.ucx.iov.recv_contig(sink.ctypes.data, sink.nbytes, 1 << 24, sink))
    stream = RecordingStream()
    with pytest.raises(Exception, match="without confirming"):
        await offerer.server.serve(offerer.request(offer, chunk_bytes=sink.nbytes), stream)
    assert stream.written == ["headers", "accepted", "sent"]
    assert offerer.d.released == [(offer.offer_id, "RELEASE_REASON_FAILED", "t-1")]
    assert offerer.d.observed[-1][2] == "failed"
    await asyncio.wait_for(receiving, 5)
    assert sink.tobytes() == b"".join(_blocks(bufs, [1, 2]))  # region-major, as the stream orders them
