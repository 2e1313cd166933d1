"""A host pool's memory as the data plane sees it: mapped here, or in the engine's process.

Shared-memory pools are mapped into the daemon, so a chunk can be a numpy view (zero-copy
sends and receives), an IOV list for UCX, or a gather/scatter with numpy. An engine's own
process memory (:class:`ProcessMemory`) is not mapped here: a chunk moves between it and a
daemon buffer with one ``process_vm_readv/writev`` per 1024 segments, and never as a view.
Both offer the same four operations, so the handoff paths do not ask which one they hold.

>>> import os
>>> from kvxferd.dataplane.cma import self_copy_works
>>> from kvxferd.dataplane.plan import RegionTable, build_plan
>>> src = np.arange(16, dtype=np.uint8)
>>> plan = build_plan(RegionTable.from_regions([(0, 0, 8, 4)]), np.array([1, 0]), 8)
>>> here = MappedMemory([src])
>>> out = np.zeros(8, dtype=np.uint8)
>>> here.gather(plan.chunks[0], out)
>>> out.tolist()
[8, 9, 10, 11, 0, 1, 2, 3]
>>> if self_copy_works():  # this process, reached the way an engine's is
...     there = ProcessMemory(os.getpid(), np.array([src.ctypes.data]), lambda: None)
...     out[:] = 0
...     there.gather(plan.chunks[0], out)
>>> out.tolist()
[8, 9, 10, 11, 0, 1, 2, 3]
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.errors import UnavailableError

from .aligned import view_like
from .cma import read_iov, write_iov
from .hostcopy import chunk_view, contiguous_iov, copy_chunk, gather_chunk, iov_at, scatter_chunk
from .plan import ChunkPlan

__all__ = ["HostMemory", "MappedMemory", "ProcessMemory", "copy_between"]

U8 = npt.NDArray[np.uint8]
IovArray = npt.NDArray[np.uint64]


class HostMemory(Protocol):
    @property
    def pid(self) -> int | None:
        """The engine's pid when the memory is another process's; None when mapped here."""

    def view(self, chunk: ChunkPlan) -> U8 | None:
        """A contiguous chunk in place, when this process can address it."""

    def iov(self, chunk: ChunkPlan) -> IovArray:
        """The chunk's pieces as ``(address, length)`` rows, in the owning process."""

    def stage(self, chunk: ChunkPlan, buf: U8) -> U8:
        """Where in ``buf`` (a staging or scratch buffer) the chunk is best staged."""

    def gather(self, chunk: ChunkPlan, out: U8) -> None:
        """Pack the chunk into ``out[:chunk.nbytes]``."""

    def scatter(self, chunk: ChunkPlan, src: U8) -> None:
        """Unpack ``src[:chunk.nbytes]`` into the chunk's pieces."""

    def keep(self) -> list[Any]:
        """What must stay referenced while UCX may touch the memory."""


class MappedMemory:
    """Buffers mapped into this process (shared-memory pools)."""

    pid = None

    def __init__(self, arrays: Sequence[U8]) -> None:
        self.arrays = arrays
        #: Where each buffer starts (read once: a numpy array's address costs a microsecond).
        self.bases = [int(a.__array_interface__["data"][0]) for a in arrays]

    def view(self, chunk: ChunkPlan) -> U8 | None:
        return chunk_view(self.arrays, chunk) if chunk.contiguous is not None else None

    def iov(self, chunk: ChunkPlan) -> IovArray:
        return iov_at(self.bases, chunk)

    def stage(self, chunk: ChunkPlan, buf: U8) -> U8:
        return buf[: chunk.nbytes]  # pools are mapped page-aligned, like the buffers

    def gather(self, chunk: ChunkPlan, out: U8) -> None:
        gather_chunk(self.arrays, chunk, out)

    def scatter(self, chunk: ChunkPlan, src: U8) -> None:
        scatter_chunk(self.arrays, chunk, src)

    def keep(self) -> list[Any]:
        return list(self.arrays)


class ProcessMemory:
    """Buffers in an engine's process at ``base`` addresses there; ``check`` raises when the
    memory may no longer be touched (session ended, process exited) and runs before each copy."""

    def __init__(
        self, pid: int, base: npt.NDArray[np.int64], check: Callable[[], None], owner: str = "engine process"
    ) -> None:
        self.pid: int = pid
        self.base = base
        self.check = check
        self.owner = owner  # what errors call the process

    def view(self, chunk: ChunkPlan) -> U8 | None:
        return None

    def iov(self, chunk: ChunkPlan) -> IovArray:
        return iov_at(self.base, chunk)

    def stage(self, chunk: ChunkPlan, buf: U8) -> U8:
        """At the offset modulo 64 of the chunk's first byte in the engine (see
        :func:`.aligned.view_like`)."""
        if chunk.contiguous is not None:
            first = int(self.base[chunk.contiguous[0]]) + chunk.contiguous[1]
        else:
            first = int(self.base[chunk.runs[0].buffer]) + int(chunk.runs[0].offsets[0])
        return view_like(buf, chunk.nbytes, first)

    def gather(self, chunk: ChunkPlan, out: U8) -> None:
        self.read_into(contiguous_iov(out[: chunk.nbytes]), chunk)

    def scatter(self, chunk: ChunkPlan, src: U8) -> None:
        self.write_from(contiguous_iov(src[: chunk.nbytes]), chunk)

    def keep(self) -> list[Any]:
        return []

    def read_into(self, local: IovArray, chunk: ChunkPlan) -> None:
        """Copy the chunk from the engine's process into ``local`` (rows in this process)."""
        self._move(read_iov, local, chunk)

    def write_from(self, local: IovArray, chunk: ChunkPlan) -> None:
        """Copy ``local`` (rows in this process) into the chunk in the engine's process."""
        self._move(write_iov, local, chunk)

    def read_rows(self, local: IovArray, remote: IovArray) -> None:
        """Copy ``remote`` (rows in the engine's process) into ``local`` (rows in this one)."""
        self._call(read_iov, local, remote)

    def _move(self, call: Callable[[int, IovArray, IovArray], None], local: IovArray, chunk: ChunkPlan) -> None:
        self._call(call, local, self.iov(chunk))

    def _call(self, call: Callable[[int, IovArray, IovArray], None], local: IovArray, remote: IovArray) -> None:
        self.check()
        try:
            call(self.pid, local, remote)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                raise UnavailableError(f"the {self.owner} {self.pid} exited") from None
            self.check()  # the session ended or the process exited meanwhile: say that
            raise UnavailableError(f"cannot reach {self.owner} {self.pid}'s memory: {exc}") from None


def copy_between(
    src: HostMemory, a: ChunkPlan, dst: HostMemory, b: ChunkPlan, scratch: U8 | None, single_pass: bool
) -> None:
    """Copy one chunk of a stream from ``src`` to ``dst``, in one pass wherever the kernel can:
    segment to segment within this process (``single_pass``) or between it and an engine's;
    through ``scratch`` between two engines' processes (no call reaches two other processes)."""
    if isinstance(src, MappedMemory) and isinstance(dst, MappedMemory):
        copy_chunk(src.arrays, a, dst.arrays, b, scratch, single_pass)
    elif isinstance(dst, ProcessMemory) and src.pid is None:
        dst.write_from(src.iov(a), b)
    elif isinstance(src, ProcessMemory) and dst.pid is None:
        src.read_into(dst.iov(b), a)
    else:
        assert scratch is not None, "a copy between two engines' processes needs scratch"
        staged = dst.stage(b, scratch)  # aligned for the write: reads are fast either way
        src.gather(a, staged)
        dst.scatter(b, staged)
