"""Direct reads: the probe's proof, and what a peer's description of its blocks may say."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from kvxfer.errors import IncompatibleError, InvalidRequestError, UnavailableError
from kvxfer.layout import Layout
from kvxfer.proto import common_pb2, peer_pb2
from kvxferd._transfers import TransferRecord
from kvxferd.dataplane.cma import self_copy_works
from kvxferd.dataplane.plan import RegionTable, build_plan
from kvxferd.memory.pools import mapped_pool
from kvxferd.peer.serve_request import read_start
from kvxferd.transports.direct import DirectRead
from kvxferd.transports.direct_proof import (
    NONCE_BYTES,
    SLOTS,
    ProofSlots,
    lent_segments,
    new_nonce,
    nonce_missing,
    probe_peer,
    source_plan,
)
from kvxferd.transports.faces import Landing

REGIONS = [(0, 0, 4096, 1024), (1, 512, 4096, 2048)]  # (buffer, offset, stride, bytes per block)


def _source(**change: object) -> tuple[peer_pb2.DirectReadSource, common_pb2.LayoutSignature]:
    fields: dict[str, object] = {
        "pid": os.getpid(),
        "buffer_address": [1 << 20, 1 << 30],
        "region_buffer": [r[0] for r in REGIONS],
        "region_offset": [r[1] for r in REGIONS],
        "region_stride": [r[2] for r in REGIONS],
        "block_ids": [3, 0, 2],
    }
    fields.update(change)
    return peer_pb2.DirectReadSource(**fields), common_pb2.LayoutSignature(block_bytes=[r[3] for r in REGIONS])


def test_a_described_source_plans_as_the_offering_daemon_would() -> None:
    source, signature = _source()
    memory, plan = source_plan(source, signature, 2048)
    own = build_plan(RegionTable.from_regions(REGIONS), np.array([3, 0, 2]), 2048)
    assert memory.pid == os.getpid() and memory.base.tolist() == [1 << 20, 1 << 30]
    assert [(c.nbytes, c.contiguous) for c in plan.chunks] == [(c.nbytes, c.contiguous) for c in own.chunks]
    assert [r.offsets.tolist() for c in plan.chunks for r in c.runs] == [
        r.offsets.tolist() for c in own.chunks for r in c.runs
    ]


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"region_offset": [0]}, IncompatibleError, "regions described"),
        ({"buffer_address": [1 << 63, 1]}, InvalidRequestError, "out of range"),
        ({"buffer_address": [0, 1 << 20]}, InvalidRequestError, "out of range"),
        ({"region_buffer": [0, 5]}, InvalidRequestError, "names a buffer"),
        ({"block_ids": []}, InvalidRequestError, "no blocks"),
        ({"buffer_address": []}, InvalidRequestError, "no buffers"),
        ({"region_stride": [1 << 40, 4096], "block_ids": [1 << 31]}, InvalidRequestError, "block id"),
    ],
)
def test_a_hostile_description_is_refused_typed(change: dict[str, object], error: type, words: str) -> None:
    source, signature = _source(**change)
    with pytest.raises(error, match=words):
        source_plan(source, signature, 2048)
    with pytest.raises(error, match=words):  # the few blocks read without a plan: the same checks
        lent_segments(source, signature)


def test_lent_segments_are_the_plans_bytes_in_stream_order() -> None:
    source, signature = _source()
    base = [1 << 20, 1 << 30]
    expected = [(base[b] + off + i * stride, n) for b, off, stride, n in REGIONS for i in (3, 0, 2)]
    assert lent_segments(source, signature) == expected


@pytest.mark.skipif(not self_copy_works(), reason="process_vm_readv is refused here")
def test_a_few_blocks_read_with_the_nonce_land_only_where_the_nonce_was_found() -> None:
    """A one-block direct read takes the nonce and the block in one call, into scratch: the
    destination gets the bytes when the nonce was there, and nothing when it was not."""
    layout = Layout.paged_kv(num_layers=1, num_blocks=8, block_bytes=64)
    src = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(layout.buffer_sizes())]
    dst = mapped_pool("dst", "dst", layout, [np.zeros(n, dtype=np.uint8) for n in layout.buffer_sizes()])
    proofs, nonce = ProofSlots(), new_nonce()
    pid, address = proofs.write(nonce)
    regions = [(r.buffer_index, r.offset, r.block_stride) for r in layout.regions]
    source = peer_pb2.DirectReadSource(
        pid=pid,
        nonce_address=address,
        buffer_address=[a.ctypes.data for a in src],
        region_buffer=[r[0] for r in regions],
        region_offset=[r[1] for r in regions],
        region_stride=[r[2] for r in regions],
        block_ids=[5],
    )

    def read(into: int, nonce_said: bytes) -> None:
        ids = np.array([into], dtype=np.int64)
        record = TransferRecord("t", "decode", common_pb2.TRANSFER_PATH_REMOTE, "o")
        peer, plan = SimpleNamespace(daemon_id="peer"), build_plan(dst.regions, ids, 1 << 20)
        landing = Landing(record, cast(Any, peer), cast(Any, None), dst, ids, plan, None)
        DirectRead(landing, cast(Any, None), source, nonce_said, layout.signature())._read_few()

    def block(arrays: list[Any], i: int) -> bytes:
        parts = (arrays[r.buffer_index][r.offset + i * r.block_stride :][: r.block_bytes] for r in layout.regions)
        return b"".join(p.tobytes() for p in parts)

    read(2, nonce)
    assert block(dst.arrays, 2) == block(src, 5)
    with pytest.raises(IncompatibleError, match="does not hold the nonce"):
        read(3, new_nonce())  # a peer naming a process that is not the one holding this nonce
    assert not any(block(dst.arrays, 3))


def test_a_lent_pool_is_checked_once_shared_read_only_and_its_errors_never_cached() -> None:
    (first, signature), (second, _) = _source(), _source(block_ids=[1])
    (memory, _), (again, plan) = source_plan(first, signature, 2048), source_plan(second, signature, 2048)
    assert again is memory and not memory.base.flags.writeable  # one view per lent pool
    assert plan.total_bytes == sum(r[3] for r in REGIONS)  # its own blocks: one here
    hostile, _ = _source(region_buffer=[0, 5])
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="names a buffer"):
            source_plan(hostile, signature, 2048)
    bare, _ = _source(region_buffer=[], region_offset=[], region_stride=[])
    with pytest.raises(InvalidRequestError, match="no regions"):
        source_plan(bare, common_pb2.LayoutSignature(), 2048)


def test_a_description_larger_than_any_pool_is_checked_but_never_remembered() -> None:
    from kvxferd.transports import direct_proof

    source, signature = _source()
    source.buffer_address.extend([1 << 20] * (2 * 4096))  # more buffers than a pool may have
    before = direct_proof._lent_pool.cache_info().currsize
    memory, _ = source_plan(source, signature, 2048)
    again, _ = source_plan(source, signature, 2048)
    assert again is not memory and direct_proof._lent_pool.cache_info().currsize == before


def test_proofs_take_only_nonces_and_reuse_slots_in_a_ring() -> None:
    proofs = ProofSlots()
    with pytest.raises(InvalidRequestError, match=f"{NONCE_BYTES} bytes"):
        proofs.write(b"short")
    first = proofs.write(new_nonce())
    assert [proofs.write(new_nonce()) for _ in range(SLOTS)][-1] == first


@pytest.mark.skipif(not self_copy_works(), reason="process_vm_readv is refused here")
def test_a_probe_holds_only_where_the_nonce_lies() -> None:
    proofs = ProofSlots()
    nonce = new_nonce()
    pid, address = proofs.write(nonce)
    assert probe_peer(peer_pb2.DirectReadProof(pid=pid, address=address), nonce, "peer")
    assert not probe_peer(peer_pb2.DirectReadProof(pid=pid, address=address), new_nonce(), "peer")
    assert not probe_peer(peer_pb2.DirectReadProof(pid=pid, address=8), nonce, "peer")  # unmapped: EFAULT
    assert not probe_peer(peer_pb2.DirectReadProof(pid=2**22 + 1, address=address), nonce, "peer")  # no such pid


def test_a_peer_whose_process_exited_is_unavailable_not_incompatible() -> None:
    """A handoff whose offering daemon died between its answer and the read fails as the dead
    peer it is (UnavailableError: retry elsewhere), not as an incompatible one."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: its pid names no process now
    with pytest.raises(UnavailableError, match=f"process {gone.pid} exited"):
        nonce_missing(gone.pid, 1 << 20, new_nonce())


@pytest.mark.parametrize("nonce", [b"x", b"y" * 17])
def test_a_start_with_a_malformed_nonce_is_refused_before_any_offer_is_claimed(nonce: bytes) -> None:

    start = peer_pb2.TransferStart(transfer_id="t-1", chunk_bytes=1 << 20, direct_read_nonce=nonce)
    with pytest.raises(InvalidRequestError, match="direct_read_nonce"):
        read_start(start, 30.0, 5.0)
    assert (
        read_start(peer_pb2.TransferStart(transfer_id="t-2", chunk_bytes=1 << 20), 30.0, 5.0).direct_read_nonce == b""
    )
