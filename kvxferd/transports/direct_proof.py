"""One-sided reads between two daemons on one host: the decode daemon copies the offered blocks
straight out of the offering daemon's memory (``process_vm_readv``), and the offering daemon
does no work per byte.

Over UCX's shared-memory transport both daemons copy every byte (the sender into a shared
FIFO, the receiver out of it) and each waits on the other, so on a busy host a transfer runs
only while both are scheduled at once: with one busy process beside them two daemons kept 0.3
of their quiet throughput (``python -m bench.lean``, ``contended``). A direct read needs only
the reader.

Who may read whom is proved, never assumed. Once per peer (``PeerService.ProbeDirectRead``)
the reader sends a fresh random nonce, the offering daemon copies it into its own memory and
names its pid and the address, and the reader reads it back from that pid: a probe that fails
(another pid namespace, another user, Yama, a seccomp profile) leaves that peer on UCX. Then
every transfer proves itself the same way: ``TransferStart.direct_read_nonce`` is copied
beside the blocks, and the reader finds it at the pid and address the offering daemon names
before a byte it read reaches a destination (a read of a few blocks takes the nonce and the
blocks in one call, into the reader's own scratch, and drops them when the nonce is not
there). Only a process the offering daemon can write holds the nonce, so what the reader
reads there, at addresses the offering daemon names, is memory the offering daemon could have
sent anyway (a recycled pid reads as a missing nonce).

>>> proofs = ProofSlots()
>>> pid, address = proofs.write(b"0123456789abcdef")
>>> found = np.zeros(16, dtype=np.uint8)
>>> from kvxferd.dataplane.cma import read_iov, self_copy_works
>>> if self_copy_works():
...     read_iov(pid, np.array([[found.ctypes.data, 16]], dtype=np.uint64), np.array([[address, 16]], dtype=np.uint64))
...     print(found.tobytes())
... else:
...     print(b"0123456789abcdef")
b'0123456789abcdef'
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import secrets
import weakref
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.errors import IncompatibleError, InvalidRequestError, UnavailableError
from kvxfer.proto import common_pb2, peer_pb2

from .._log import log_event
from ..dataplane.cma import IOV_MAX, read_few, read_iov
from ..dataplane.hostmem import IovArray, ProcessMemory
from ..dataplane.plan import RegionTable, SidePlan, build_layered_plan, build_plan
from ..dataplane.remap import Side, peer_side, plan_remap
from ..dataplane.segment_reads import segment_rows
from ..memory.pools import MAX_BUFFERS, Pool
from ..peer.serve_request import NONCE_BYTES

__all__ = [
    "DIRECT_READ",
    "NONCE_BYTES",
    "ProofSlots",
    "lent_rows",
    "lent_segments",
    "new_nonce",
    "nonce_missing",
    "probe_peer",
    "source_of",
    "source_plan",
]

#: The transport a direct read reports (records, metrics, kvxferctl).
DIRECT_READ = "direct:cma"
#: Proofs kept at once: a probe's slot is reused only after this many later probes.
SLOTS = 64
#: Addresses, offsets and strides beyond this are refused (they could only overflow).
_MAX_ADDRESS = 1 << 62


class ProofSlots:
    """The offering side of a probe: nonces copied into this daemon's memory, in a ring
    (``enabled``: the daemon's ``same_host_direct_read``; off, every probe is refused)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._slots = np.zeros((SLOTS, NONCE_BYTES), dtype=np.uint8)
        self._next = 0

    def write(self, nonce: bytes) -> tuple[int, int]:
        """Copy ``nonce`` into a slot; returns ``(pid, address)`` where it now lies."""
        if not self.enabled:
            raise IncompatibleError("direct reads are off on this daemon (same_host_direct_read: false)")
        if len(nonce) != NONCE_BYTES:
            raise InvalidRequestError(f"a direct-read probe's nonce is {NONCE_BYTES} bytes, not {len(nonce)}")
        slot = self._slots[self._next]
        self._next = (self._next + 1) % SLOTS
        slot[:] = np.frombuffer(nonce, dtype=np.uint8)
        return os.getpid(), int(slot.ctypes.data)


def probe_peer(proof: peer_pb2.DirectReadProof, nonce: bytes, peer_id: str) -> bool:
    """Whether the nonce lies at the proof's pid and address (read with process_vm_readv)."""
    try:
        why = nonce_missing(int(proof.pid), int(proof.address), nonce)
    except UnavailableError as exc:
        why = str(exc)
    if why:
        log_event("direct_read.off", logging.INFO, peer=peer_id, reason=why)
        return False
    log_event("direct_read.on", peer=peer_id, pid=proof.pid)
    return True


def nonce_missing(
    pid: int,
    address: int,
    nonce: bytes,
    segments: Sequence[tuple[int, int]] = (),
    into: npt.NDArray[np.uint8] | None = None,
) -> str:
    """Why ``nonce`` cannot be read at ``address`` in process ``pid`` ("" when it can);
    raises UnavailableError when that process has exited (a dead peer, not an incompatible one).
    ``segments`` ``(address, bytes)`` there are read into ``into`` by the same call (their
    bytes count only when the nonce was found)."""
    found = np.zeros(NONCE_BYTES, dtype=np.uint8)
    local = [(found.ctypes.data, NONCE_BYTES)]
    if into is not None:
        local.append((into.ctypes.data, into.nbytes))
    if not 0 < address < _MAX_ADDRESS:
        return f"nonce address {address:#x} out of range"
    remote = [(address, NONCE_BYTES), *segments]
    try:
        if len(remote) <= IOV_MAX:  # a probe, or a read of a few blocks: no arrays to build
            read_few(pid, local, remote)
        else:
            read_iov(pid, np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64))
    except ProcessLookupError:
        raise UnavailableError(f"the peer daemon's process {pid} exited") from None
    except OSError as exc:
        return f"cannot read the peer's memory: {exc}"
    if not hmac.compare_digest(found.tobytes(), nonce):
        return f"pid {pid} does not hold the nonce"
    return ""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def source_of(
    pool: Pool, src_ids: npt.NDArray[np.int64], nonce: bytes
) -> tuple[peer_pb2.DirectReadSource, npt.NDArray[np.uint8]] | None:
    """Where an offered pool's blocks lie in this daemon, for a reader on this host, and the
    reader's ``nonce`` copied into memory of its own (keep it referenced until the transfer
    ends); None when the pool is not mapped here (GPU memory, an engine's own process memory)."""
    if pool.device is not None or pool.process is not None:
        return None
    if len(nonce) != NONCE_BYTES:
        raise InvalidRequestError(f"a direct read's nonce is {NONCE_BYTES} bytes, not {len(nonce)}")
    held = np.frombuffer(nonce, dtype=np.uint8).copy()
    source = peer_pb2.DirectReadSource()
    source.CopyFrom(_described(pool))
    source.nonce_address = int(held.ctypes.data)
    source.block_ids.extend(np.asarray(src_ids).tolist())
    return source, held


#: Pools whose description is kept (by pool id, with a weak reference to the pool it describes:
#: a deregistered pool's memory must not stay mapped for this).
_DESCRIBED: dict[str, tuple[weakref.ref[Pool], peer_pb2.DirectReadSource]] = {}


def _described(pool: Pool) -> peer_pb2.DirectReadSource:
    """Where a pool mapped here lies (pid, buffers, regions): the same for every pull of its
    offers, so built once per pool (a pull copies it and adds its nonce and blocks)."""
    kept = _DESCRIBED.get(pool.pool_id)
    if kept is None or kept[0]() is not pool:
        regions = pool.regions
        described = peer_pb2.DirectReadSource(
            pid=os.getpid(),
            buffer_address=[int(a.ctypes.data) for a in pool.arrays],
            region_buffer=regions.buffer.tolist(),
            region_offset=regions.offset.tolist(),
            region_stride=regions.stride.tolist(),
        )
        if len(_DESCRIBED) >= _LENT_POOLS:
            _DESCRIBED.clear()
        kept = _DESCRIBED[pool.pool_id] = (weakref.ref(pool), described)
    return kept[1]


def source_plan(
    source: peer_pb2.DirectReadSource,
    sender: common_pb2.LayoutSignature,
    chunk_bytes: int,
    remap_to: Side | None = None,
    layers: int = 0,
) -> tuple[ProcessMemory, SidePlan]:
    """The offering daemon's memory and its side of the stream, from what it said (checked:
    a hostile peer's numbers fail here, as typed errors, or read only its own memory).
    ``remap_to``: the destination's side, where the two sides cut blocks otherwise; ``layers``:
    chunks cut per layer, for a layer-wise read."""
    memory, regions = _lent(source, sender)
    ids = np.asarray(source.block_ids, dtype=np.int64)
    if remap_to is not None:
        plan = plan_remap(peer_side(sender, len(ids), regions, ids), remap_to, chunk_bytes, "src")
    elif layers:
        if len(regions.nbytes) % layers:
            raise IncompatibleError(f"direct read: {len(regions.nbytes)} regions do not make {layers} layers")
        plan = build_layered_plan(regions, ids, chunk_bytes, layers)[0]
    else:
        plan = build_plan(regions, ids, chunk_bytes)
    return memory, plan


def lent_segments(source: peer_pb2.DirectReadSource, sender: common_pb2.LayoutSignature) -> list[tuple[int, int]]:
    """The lent blocks' segments ``(address, bytes)`` in the offering daemon, in stream order
    (region-major, then the offer's block order): checked as :func:`source_plan` checks them,
    for a read of a few segments that needs no plan."""
    memory, regions = _lent(source, sender)
    base, (buffer, offset, stride, nbytes) = memory.base.tolist(), regions.lists
    ids = list(source.block_ids)
    return [(base[buffer[r]] + offset[r] + i * stride[r], nbytes[r]) for r in range(len(nbytes)) for i in ids]


def lent_rows(source: peer_pb2.DirectReadSource, sender: common_pb2.LayoutSignature) -> tuple[ProcessMemory, IovArray]:
    """The offering daemon's memory and the lent blocks' segments there as ``(address,
    length)`` rows in stream order: checked as :func:`source_plan` checks them, for a read
    segment to segment that needs no plan (:mod:`..dataplane.segment_reads`)."""
    memory, regions = _lent(source, sender)
    return memory, segment_rows(memory.base, regions, np.array(list(source.block_ids), dtype=np.int64))


def _lent(source: peer_pb2.DirectReadSource, sender: common_pb2.LayoutSignature) -> tuple[ProcessMemory, RegionTable]:
    """The lent pool's memory and regions, its block ids checked against it."""
    # A peer's description of a pool larger than any a daemon registers is checked uncached:
    # the cache holds only what honest pools look like.
    small = len(source.buffer_address) + len(source.region_offset) <= _CACHED_ENTRIES
    memory, regions, id_bound = (_lent_pool if small else _check_lent_pool)(
        int(source.pid),
        tuple(source.buffer_address),
        tuple(source.region_buffer),
        tuple(source.region_offset),
        tuple(source.region_stride),
        tuple(sender.block_bytes),
    )
    if not source.block_ids:
        raise InvalidRequestError("direct read: no blocks described")
    if max(source.block_ids) >= id_bound:
        raise InvalidRequestError("direct read: a block id out of range")
    return memory, regions


def _check_lent_pool(
    pid: int,
    buffers: tuple[int, ...],
    region_buffer: tuple[int, ...],
    region_offset: tuple[int, ...],
    region_stride: tuple[int, ...],
    block_bytes: tuple[int, ...],
) -> tuple[ProcessMemory, RegionTable, int]:
    """A lent pool's memory and regions, checked, and the bound its block ids stay under. The
    same pool is lent for every pull of its offers: checked and built once per (pid, layout),
    read-only (an error is raised afresh each time, never cached)."""
    n = len(block_bytes)
    if not (len(region_buffer) == len(region_offset) == len(region_stride) == n):
        raise IncompatibleError(f"direct read: {len(region_offset)} regions described, the signature has {n}")
    if not buffers or not n:
        raise InvalidRequestError("direct read: no buffers or no regions described")
    if max((*buffers, *region_offset, *region_stride, *block_bytes)) >= _MAX_ADDRESS or min(buffers) == 0:
        raise InvalidRequestError("direct read: an address, offset or stride out of range")
    if max(region_buffer) >= len(buffers):
        raise InvalidRequestError("direct read: a region names a buffer that was not described")
    columns = [np.array(c, dtype=np.int64) for c in (region_buffer, region_offset, region_stride, block_bytes)]
    base = np.array(buffers, dtype=np.int64)
    for array in (*columns, base):
        array.flags.writeable = False  # shared by every pull of this pool
    memory = ProcessMemory(pid, base, _never, "peer daemon")
    return memory, RegionTable(*columns), _MAX_ADDRESS // max(1, max(region_stride))


#: Lent pools remembered (each a few KiB), and the most buffers plus regions one may describe
#: to be remembered (a pool has at most MAX_BUFFERS buffers; its regions are of that order).
_LENT_POOLS, _CACHED_ENTRIES = 64, 2 * MAX_BUFFERS
_lent_pool = functools.lru_cache(maxsize=_LENT_POOLS)(_check_lent_pool)


def _never() -> None:
    """The peer daemon's memory has no session to end: its process exiting is the failure."""
