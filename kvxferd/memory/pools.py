"""Registered pools: the engines' buffers, mapped into the daemon, with their layouts.

Three kinds of memory: shared memory the engine passed as a descriptor (mapped here), the
engine's own process memory (reached through the kernel, :mod:`.process`), and GPU memory
(CUDA IPC). Every byte the data plane touches is derived from (pool, region, block id); block ids are
checked against ``num_blocks`` here and the layout was checked against the mapped buffer
sizes at registration, so no offset a plan computes can leave its buffer.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.errors import AlreadyExistsError, IncompatibleError, InvalidRequestError, NotFoundError
from kvxfer.host_memory import HostBuffer
from kvxfer.layout import Layout
from kvxfer.proto import common_pb2

from ..dataplane.hostmem import HostMemory, MappedMemory, ProcessMemory
from ..dataplane.plan import RegionTable
from .process import EngineProcess, range_ends
from .seals import seal_against_shrinking

__all__ = [
    "PROCESS_MEMORY_OFF_GPU",
    "Pool",
    "PoolRegistry",
    "Registrant",
    "mapped_pool",
    "regions_of",
]

U8 = npt.NDArray[np.uint8]
MAX_BUFFERS = 4096
PROCESS_MEMORY_OFF_GPU = (
    "a GPU pool cannot be copied to or from an engine's own process memory on one daemon (GPU kernels "
    "reach only memory mapped here): register that host memory as shared memory (kvxfer_client.HostBuffer)"
)


#: Bytes of a pool's offer key.
OFFER_KEY_BYTES = 16
_POOL_ID = re.compile(r"pool-[0-9a-f]{12}")


class Registrant(Protocol):
    """The engine session registering a pool (kvxferd's Session): who it is, the descriptors
    it passed over the fd socket, and its attached process."""

    session_id: str
    process: EngineProcess | None

    def take_fd(self, handle: str) -> int | None: ...


@dataclass(frozen=True)
class PoolIdentity:
    """What references a pool from outside its session: its id and offer key."""

    pool_id: str
    offer_key: bytes = field(repr=False)


@dataclass
class Pool:
    pool_id: str
    name: str
    session_id: str
    layout: Layout
    kind: int
    #: One writable uint8 view per buffer: numpy for shared-memory pools, CuPy for GPU pools;
    #: empty for process pools (their memory is not mapped here).
    arrays: list[Any]
    regions: RegionTable
    fingerprint: str
    nbytes: int
    #: Each buffer's address: in this process (shared memory: the mapping; GPU: the device
    #: pointer) or, for process pools, in the engine's process.
    base: npt.NDArray[np.int64]
    #: GPU pools: the device ordinal (in this process) and UUID.
    device: int | None = None
    gpu_uuid: str = ""
    #: Process pools: the engine process whose memory this is.
    process: EngineProcess | None = None
    #: Lets another session of the same engine offer this pool's blocks (OfferRequest.offer_key).
    offer_key: bytes = field(default_factory=lambda: secrets.token_bytes(OFFER_KEY_BYTES), repr=False)
    offers: set[str] = field(default_factory=set)
    #: Transfers currently reading or writing this pool's memory.
    busy: int = 0
    #: Deregistered: unmapped when ``busy`` drops to 0.
    closing: bool = False
    #: Host pools: pinned for GPU kernels (done on first GPU use, undone at close).
    pinned: bool = False
    _closers: list[Callable[[], None]] = field(default_factory=list)
    #: The mapped pool's memory, made once: it shares ``arrays``, which ``close`` empties.
    _mapped: MappedMemory | None = field(default=None, repr=False)

    @functools.cached_property
    def range_ends(self) -> npt.NDArray[np.uint64]:
        """The first and last byte of each buffer (made once: a process pool's offers probe
        them, :meth:`EngineProcess.probe`)."""
        return range_ends(self.base, np.array(self.layout.buffer_sizes(), dtype=np.int64))

    @property
    def on_gpu(self) -> bool:
        return self.device is not None

    @property
    def device_name(self) -> str:
        return self.gpu_uuid or "cpu"

    def host_memory(self) -> HostMemory:
        """The pool's host memory as the data plane moves it (not for GPU pools)."""
        assert not self.on_gpu
        if self.process is not None:
            return ProcessMemory(self.process.pid, self.base, self.process.check)
        if self._mapped is None:
            self._mapped = MappedMemory(self.arrays)
        return self._mapped

    def pin_for_gpu(self) -> None:
        """Make a host pool addressable by GPU kernels (cudaHostRegister), once."""
        if self.on_gpu or self.pinned:
            return
        if self.process is not None:
            raise IncompatibleError(PROCESS_MEMORY_OFF_GPU)
        from .cuda_ipc import register_host, unregister_host

        done: list[int] = []
        try:
            for ptr, arr in zip(self.base.tolist(), self.arrays, strict=True):
                register_host(ptr, arr.nbytes)
                done.append(ptr)
        except BaseException:
            for ptr in done:
                unregister_host(ptr)
            raise
        self.pinned = True

        def unpin() -> None:
            for ptr in done:
                unregister_host(ptr)

        self._closers.insert(0, unpin)  # before the host mappings go

    @contextlib.contextmanager
    def in_use(self) -> Iterator[Pool]:
        """A transfer reads or writes this pool's memory inside this block: a deregistration
        meanwhile unmaps it only when the last such block ends (UCX or a copy thread writing
        into unmapped memory would crash the daemon)."""
        self.busy += 1
        try:
            yield self
        finally:
            self.busy -= 1
            if self.closing and self.busy == 0:
                self.close()

    def close_when_idle(self) -> None:
        """Deregistered: unmap now, or when the last transfer using the pool ends."""
        self.closing = True
        if self.busy == 0:
            self.close()

    def close(self) -> None:
        self.arrays.clear()
        closers, self._closers = self._closers, []
        for close in closers:
            close()


def regions_of(layout: Layout) -> RegionTable:
    """A layout's regions as the data plane plans with them."""
    return RegionTable.from_regions((r.buffer_index, r.offset, r.block_stride, r.block_bytes) for r in layout.regions)


def mapped_pool(pool_id: str, name: str, layout: Layout, arrays: list[U8]) -> Pool:
    """A pool of memory mapped in the daemon that no engine session owns (the node's KV tier):
    offered and pulled like an engine's host pool."""
    return Pool(
        pool_id=pool_id,
        name=name,
        session_id="",
        layout=layout,
        kind=common_pb2.MEMORY_KIND_HOST_SHM,
        arrays=arrays,
        regions=regions_of(layout),
        fingerprint=layout.fingerprint(),  # as any pool of this layout: tickets of its blocks fit
        nbytes=sum(a.nbytes for a in arrays),
        base=np.array([a.ctypes.data for a in arrays], dtype=np.int64),
    )


class PoolRegistry:
    def __init__(self) -> None:
        self.pools: dict[str, Pool] = {}
        #: Why GPU buffers cannot be registered here ("" when they can); probed on first use.
        self._gpu_unsupported: str | None = None
        self.ipc: Any = None  # IpcMappings, created with the first GPU pool

    @property
    def gpu_unsupported(self) -> str:
        if self._gpu_unsupported is None:
            from .cuda_ipc import gpu_support

            self._gpu_unsupported = gpu_support()
        return self._gpu_unsupported

    def register(
        self,
        session: Registrant,
        buffers: Sequence[common_pb2.BufferSpec],
        layout_msg: common_pb2.Layout,
        name: str,
        keep: PoolIdentity | None = None,
    ) -> Pool:
        """Map a pool; ``keep``: the id and offer key it had before the daemon restarted (the
        engine's other sessions still hold them), else fresh ones."""
        identity = self._identity(keep)
        if not buffers or len(buffers) > MAX_BUFFERS:
            raise InvalidRequestError(f"a pool needs 1..{MAX_BUFFERS} buffers")
        if len(name) > 256:
            raise InvalidRequestError("pool name longer than 256 characters")
        layout = Layout.from_proto(layout_msg)
        layout.validate([b.size for b in buffers])
        kinds = {b.kind for b in buffers}
        if len(kinds) != 1:
            raise InvalidRequestError("all buffers of a pool must be of one memory kind")
        kind = kinds.pop()
        regions = regions_of(layout)
        process = None
        if kind == common_pb2.MEMORY_KIND_HOST_SHM:
            arrays, closers, device, uuid = self._map_host(buffers, session)
            base = np.array([a.ctypes.data for a in arrays], dtype=np.int64)
        elif kind == common_pb2.MEMORY_KIND_HOST_PROCESS:
            process, base = self._reach_process(buffers, session)
            arrays, closers, device, uuid = [], [process.release], None, ""
        elif kind == common_pb2.MEMORY_KIND_CUDA_IPC:
            arrays, closers, device, uuid, base = self._map_gpu(buffers)
        else:
            raise InvalidRequestError(f"unknown memory kind {kind}")
        pool = Pool(
            pool_id=identity.pool_id,
            offer_key=identity.offer_key,
            name=name,
            session_id=session.session_id,
            layout=layout,
            kind=kind,
            arrays=arrays,
            regions=regions,
            fingerprint=layout.fingerprint(),
            nbytes=sum(int(b.size) for b in buffers),
            base=base,
            device=device,
            gpu_uuid=uuid,
            process=process,
            _closers=closers,
        )
        self.pools[pool.pool_id] = pool
        return pool

    def _identity(self, keep: PoolIdentity | None) -> PoolIdentity:
        """``keep`` checked (an engine's word: its shape, and no pool of that id here), or a
        fresh id and key."""
        if keep is None or not (keep.pool_id or keep.offer_key):
            return PoolIdentity("pool-" + secrets.token_hex(6), secrets.token_bytes(OFFER_KEY_BYTES))
        if not _POOL_ID.fullmatch(keep.pool_id) or len(keep.offer_key) != OFFER_KEY_BYTES:
            raise InvalidRequestError(
                f"a pool registered again keeps the id and offer key an earlier registration returned "
                f"('pool-' and 12 hex digits, and {OFFER_KEY_BYTES} bytes): got {keep.pool_id[:40]!r} and "
                f"{len(keep.offer_key)} bytes"
            )
        if keep.pool_id in self.pools:
            raise AlreadyExistsError(f"pool {keep.pool_id} is registered already: register it again only once")
        return keep

    @staticmethod
    def _map_host(
        buffers: Sequence[common_pb2.BufferSpec], session: Registrant
    ) -> tuple[list[Any], list[Callable[[], None]], None, str]:
        """Map each buffer from the descriptor the engine passed (never by name: the daemon
        must not open memory the engine could not open itself)."""
        if any(spec.shm_name for spec in buffers):
            raise InvalidRequestError(
                "host buffers are registered by passed file descriptor, not by name "
                "(upgrade kvxfer_client: it passes them over <engine socket>.fds)"
            )
        fds = [session.take_fd(spec.fd_handle) for spec in buffers]
        mappings: list[HostBuffer] = []
        try:
            for i, (spec, fd) in enumerate(zip(buffers, fds, strict=True)):
                if fd is None:
                    raise InvalidRequestError(
                        f"buffer {i}: unknown fd_handle {spec.fd_handle[:40]!r} (pass the descriptor on the fd "
                        "socket first, in this session; each handle registers once)"
                    )
                seal_against_shrinking(fd, f"buffer {i}")  # else the engine could SIGBUS the daemon
                mappings.append(HostBuffer.map_fd(fd, spec.size, f"buffer {i}"))
        except BaseException:
            for m in mappings:
                m.close()
            raise
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)  # the mappings keep the memory
        closers: list[Callable[[], None]] = [functools.partial(m.close, detach=True) for m in mappings]
        return [m.array() for m in mappings], closers, None, ""

    @staticmethod
    def _reach_process(
        buffers: Sequence[common_pb2.BufferSpec], session: Registrant
    ) -> tuple[EngineProcess, npt.NDArray[np.int64]]:
        """Check the ranges against the attached engine process; nothing is mapped."""
        process = session.process
        if process is None:
            raise InvalidRequestError(
                "process memory needs the engine's process attached to this session first "
                "(kvxfer_client attaches it over <engine socket>.fds before registering)"
            )
        ranges = [(int(spec.process_address), int(spec.size)) for spec in buffers]
        process.check_ranges(ranges)
        process.hold()
        return process, np.array([a for a, _ in ranges], dtype=np.int64)

    def _map_gpu(
        self, buffers: Sequence[common_pb2.BufferSpec]
    ) -> tuple[list[Any], list[Callable[[], None]], int, str, npt.NDArray[np.int64]]:
        if self.gpu_unsupported:
            raise InvalidRequestError(f"this daemon cannot map GPU memory: {self.gpu_unsupported}")
        uuids = {b.gpu_uuid for b in buffers}
        if len(uuids) != 1:
            raise InvalidRequestError("all GPU buffers of a pool must be on one GPU (register one pool per GPU)")
        if self.ipc is None:
            from .cuda_ipc import IpcMappings

            self.ipc = IpcMappings()
        ipc = self.ipc
        mapped = []
        try:
            for spec in buffers:
                mapped.append(ipc.map(spec))
        except BaseException:
            for m in mapped:
                ipc.unmap(m)
            raise
        closers: list[Callable[[], None]] = [functools.partial(ipc.unmap, m) for m in mapped]
        base = np.array([m.ptr for m in mapped], dtype=np.int64)
        return [m.array for m in mapped], closers, mapped[0].device, uuids.pop(), base

    def get(self, pool_id: str) -> Pool:
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFoundError(
                f"no pool {pool_id!r} on this daemon (pools die with their session and with a daemon restart: "
                "reconnect() registers a client's pools again)"
            )
        return pool

    def remove(self, pool_id: str) -> Pool:
        pool = self.get(pool_id)
        del self.pools[pool_id]
        return pool

    @property
    def registered_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())
