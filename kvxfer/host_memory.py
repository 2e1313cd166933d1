"""Host memory the daemon can map: shared memory created by the engine (a memfd sealed
against shrinking, so the engine cannot pull pages from under the daemon).

The engine hands the daemon its open file descriptor (SCM_RIGHTS over the daemon's fd socket),
never a name: the daemon can then map only memory the engine itself could open, whatever the
two processes' users, groups and umasks. The memory has no name in ``/dev/shm``, so nothing is
left there if the engine dies, and the same buffer can be registered again (after a daemon
restart) from the descriptor it keeps.

>>> buf = HostBuffer.create(4096)
>>> buf.array()[:4] = [1, 2, 3, 4]
>>> HostBuffer.map_fd(buf.fd, 4096, "buffer").array()[:4].tolist()
[1, 2, 3, 4]
>>> os.path.exists(os.path.join(SHM_DIR, buf.name))
False
>>> os.ftruncate(buf.fd, 0)
Traceback (most recent call last):
...
PermissionError: [Errno 1] Operation not permitted
>>> buf.close()
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import InvalidRequestError, ResourceExhaustedError
from .proto import common_pb2

__all__ = ["MEMORY_KIND_NAMES", "SHM_DIR", "HostBuffer", "check_shm_name"]

SHM_DIR = "/dev/shm"

#: How kvxferctl, the metrics and the logs name a pool's memory: "host" (shared memory passed as
#: a descriptor), "process" (the engine's own memory, reached through the kernel), "cuda".
MEMORY_KIND_NAMES: dict[int, str] = {
    common_pb2.MEMORY_KIND_HOST_SHM: "host",
    common_pb2.MEMORY_KIND_HOST_PROCESS: "process",
    common_pb2.MEMORY_KIND_CUDA_IPC: "cuda",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def check_shm_name(name: str) -> str:
    """Return ``name`` if it is a plain shared-memory name (no path, no traversal)."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise InvalidRequestError(f"invalid shared-memory name {name!r}")
    return name


#: ``madvise`` advice that faults every page of a range in for writing (Linux 5.14); the
#: ``mmap`` module of Python 3.11 does not name it.
MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


def _not_writable(fd: int) -> str:
    """Why a shared-memory file cannot be mapped for writing: sealed, or opened read-only."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd: no seals
    if seals & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
        return (
            "the memfd is sealed against writes (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE), and a pool's blocks are "
            "written by pulls: register it before sealing, or a memfd without write seals"
        )
    return "the descriptor is not open for reading and writing (open it O_RDWR)"


#: Linux's F_SEAL_FUTURE_WRITE (5.1), which Python's fcntl module does not name.
_F_SEAL_FUTURE_WRITE = 0x0010


def _map(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of the shared-memory file ``fd``: huge pages where allowed, every
    page faulted in now.

    Huge pages: shared memory lets a mapping ask for them where the kernel allows it
    (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` ``advise`` for memfds, tmpfs
    ``huge=advise`` for ``/dev/shm`` files). A copy between two processes walks the pages of both sides, and 2 MiB pages
    make that walk 512 times shorter: plain UCX sends between 256 MiB buffers ran at 3.9 GB/s
    on 4 KiB pages and 6.5-7.6 GB/s on huge ones on the development VM. The advice must come
    before the first fault, so the mapping is populated after it rather than by
    ``MAP_POPULATE``.

    Populating: a KV pool is used whole and often, and a page fault during a transfer costs
    more than copying the page.
    """
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # kernel without transparent huge pages: 4 KiB pages, still correct
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            # EFAULT / ENOMEM: /dev/shm (or memory) is full. Touching the pages later would
            # kill the process with SIGBUS, so say so now.
            mapping.close()
            raise OSError(
                exc.errno, f"cannot back {size} bytes of shared memory ({exc.strerror}): is /dev/shm full or too small?"
            ) from None
        # Kernels before 5.14 do not know the advice: one read per page faults it in.
        int(np.frombuffer(mapping, dtype=np.uint8, count=size)[::_PAGE].sum())
    return mapping


_PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS_FIXED = 0x02 | 0x20 | 0x10


def _detach(address: int, size: int) -> None:
    """Replace ``size`` bytes of mapping at ``address`` with private anonymous memory
    (``mmap(MAP_FIXED)``): same addresses, none of the old pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    got = libc.mmap(address, size, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS_FIXED, -1, 0)
    if got != address:
        raise OSError(ctypes.get_errno(), f"could not detach {size} bytes of shared memory")


class HostBuffer:
    """A POSIX shared-memory buffer, mapped read-write in this process.

    The creator unlinks the name when it closes the buffer (or at ``unlink()``); mappings
    made before that stay valid.
    """

    def __init__(self, name: str, size: int, mapping: mmap.mmap, owner: bool, fd: int = -1) -> None:
        self.name = name
        self.size = size
        self._mmap: mmap.mmap | None = mapping
        self._address = int(np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data)
        self._owner = owner
        #: The open descriptor (buffers made by :meth:`create`), passed to the daemon at
        #: registration; -1 for mappings made from a name or a passed descriptor.
        self.fd = fd

    @classmethod
    def create(cls, size: int, *, prefix: str = "kvxfer", named: bool = False) -> HostBuffer:
        """Create and map a new zero-filled shared-memory buffer of ``size`` bytes: a memfd
        sealed against shrinking (``F_SEAL_SHRINK``), which is what the daemon maps.

        ``named``: a file under ``/dev/shm`` instead, kept until :meth:`close` (for
        :meth:`attach` from another process); it cannot be sealed, so the daemon refuses it.
        """
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        name = f"{check_shm_name(prefix)}-{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(SHM_DIR, name)
        if named:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        else:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            if not named:  # the daemon maps only memory nobody can shrink under it (SIGBUS)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            mapping = _map(fd, size)
        except BaseException:
            os.close(fd)
            if named:
                os.unlink(path)
            raise
        return cls(name, size, mapping, owner=named, fd=fd)

    @classmethod
    def map_fd(cls, fd: int, size: int, what: str) -> HostBuffer:
        """Map ``size`` bytes of a passed descriptor (the daemon does this at registration);
        the caller keeps (and closes) ``fd``."""
        try:
            info = os.fstat(fd)
        except OSError:
            raise InvalidRequestError(f"{what}: not an open file descriptor") from None
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRequestError(f"{what}: the descriptor is not a shared-memory file")
        if size <= 0 or size > info.st_size:
            raise InvalidRequestError(f"{what}: the file has {info.st_size} bytes, {size} were declared")
        try:
            mapping = _map(fd, size)
        except PermissionError:
            raise InvalidRequestError(f"{what}: {_not_writable(fd)}") from None
        except OSError as exc:
            raise ResourceExhaustedError(f"cannot map {what}: {exc.strerror}") from None
        return cls("", size, mapping, owner=False)

    @classmethod
    def attach(cls, name: str, size: int | None = None) -> HostBuffer:
        """Map an existing buffer by name (the daemon does this at registration)."""
        path = os.path.join(SHM_DIR, check_shm_name(name))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise InvalidRequestError(f"shared-memory buffer {name!r} does not exist") from None
        except PermissionError:
            raise InvalidRequestError(f"no permission to open shared-memory buffer {name!r}") from None
        try:
            actual = os.fstat(fd).st_size
            if size is None:
                size = actual
            if size <= 0 or size > actual:
                raise InvalidRequestError(f"shared-memory buffer {name!r} has {actual} bytes, {size} were declared")
            mapping = _map(fd, size)
        except OSError as exc:
            raise ResourceExhaustedError(f"cannot map shared-memory buffer {name!r}: {exc.strerror}") from None
        finally:
            os.close(fd)
        return cls(name, size, mapping, owner=False)

    def array(self) -> npt.NDArray[np.uint8]:
        """The whole buffer as a writable ``uint8`` numpy array (a view, no copy)."""
        if self._mmap is None:
            raise ValueError(f"buffer {self.name!r} is closed")
        return np.frombuffer(self._mmap, dtype=np.uint8, count=self.size)

    def unlink(self) -> None:
        """Remove the name; existing mappings stay valid."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self, *, detach: bool = False) -> None:
        """Unmap (once no numpy view is alive), close the descriptor and, for the creator of
        a named buffer, unlink the name.

        ``detach`` (the daemon, for a deregistered pool): if views are still alive (a UCX
        receive that was never confirmed cancelled holds one), put private zero pages in
        place of the shared memory now. The shared memory is released at once; a late write
        lands in memory nobody reads instead of in the engine's (or a fault)."""
        if self._owner:
            self.unlink()
            self._owner = False
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                # numpy views are alive; the mapping goes when the last one does.
                if detach:
                    _detach(self._address, self.size)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostBuffer(name={self.name!r}, size={self.size})"
