"""An engine's own process, attached to its session: the daemon reaches its memory as it is.

vLLM on CPU keeps its KV caches in ordinary heap tensors, and an engine may hand kvxfer any
CPU tensor. Copying such memory into shared memory would double it; instead the engine
attaches its process on the fd socket, and the daemon reads and writes the registered ranges
with ``process_vm_readv/writev`` (:mod:`kvxferd.dataplane.cma`).

Who the process is comes from the kernel, never from a request: the peer credentials of the
engine's connection on the fd socket (``SO_PEERPIDFD`` where the kernel has it, else the pid of
``SO_PEERCRED`` opened as a pidfd and checked to still belong to the same user). The pidfd pins
the identity: before every copy the daemon checks the process has not exited, so a pid the
kernel hands to another process later is never written. The attachment ends with the session
(engine disconnects), and with it every pool registered from it.

What the daemon may touch is what the kernel lets it: each range must lie in mappings the
process has readable and writable (``/proc/<pid>/maps``), and a probe read at registration
turns a refusal (another user, no ``CAP_SYS_PTRACE``, a Yama ``ptrace_scope``) into a clear
error naming the fix instead of a failed transfer later.
"""

from __future__ import annotations

import bisect
import errno
import os
import select
import socket
import struct
from collections.abc import Sequence

import numpy as np

from kvxfer.errors import InvalidRequestError, PermissionDeniedError, UnavailableError

from ..dataplane.cma import read_iov

__all__ = ["EngineProcess", "attach_peer", "range_ends"]

#: ``SO_PEERPIDFD`` (Linux 6.5); Python 3.11's socket module does not name it.
SO_PEERPIDFD = 77

_SHARED_MEMORY_FIX = (
    "register the memory as shared memory instead (kvxfer_client.HostBuffer.create), "
    "or run the engine as the daemon's user"
)


class EngineProcess:
    """The engine process attached to one session (pid pinned by a pidfd)."""

    def __init__(self, pid: int, pidfd: int, uid: int) -> None:
        self.pid = pid
        self.uid = uid
        self._pidfd = pidfd
        #: Pools registered from this process and not yet closed (they keep the pidfd open).
        self._pools = 0
        self.ended = False

    def __repr__(self) -> str:
        return f"EngineProcess(pid={self.pid}, uid={self.uid}, ended={self.ended})"

    # -- life ------------------------------------------------------------------------------

    def exited(self) -> bool:
        """Whether the process has exited (its pidfd turned readable)."""
        if self._pidfd < 0:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], 0)
        return bool(ready)

    def check(self) -> None:
        """Raise unless the memory may still be touched: the session lives and so does the
        process (called before every copy, from any thread)."""
        if self.ended:
            raise UnavailableError(f"the engine session of pid {self.pid} ended: its memory is no longer reachable")
        if self.exited():
            raise UnavailableError(f"the engine process {self.pid} exited")

    def hold(self) -> None:
        """A pool was registered from this process."""
        self._pools += 1

    def release(self) -> None:
        """A pool registered from this process was closed."""
        self._pools -= 1
        self._close_if_done()

    def end(self) -> None:
        """The session ended: no copy may start from now on."""
        self.ended = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        # Copies run only while a pool is in use, so the pidfd stays open under every check.
        if self.ended and self._pools == 0 and self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    # -- registration ----------------------------------------------------------------------

    def check_ranges(self, ranges: Sequence[tuple[int, int]], what: str = "buffer") -> None:
        """Refuse unless every ``(address, size)`` lies in mappings the process has readable
        and writable, and the daemon may read there (one probe byte per range)."""
        self.check()
        starts, ends, perms = self._mappings()
        for i, (address, size) in enumerate(ranges):
            if size <= 0 or address <= 0 or address + size > 1 << 64:
                raise InvalidRequestError(f"{what} {i}: address {address:#x} size {size} is not a memory range")
            at, end = address, address + size
            while at < end:
                k = bisect.bisect_right(starts, at) - 1
                if k < 0 or ends[k] <= at:
                    raise InvalidRequestError(
                        f"{what} {i}: {at:#x} is not mapped in engine process {self.pid} "
                        f"(the range {address:#x}+{size} must be memory the engine keeps alive while registered)"
                    )
                if not perms[k].startswith("rw"):
                    raise InvalidRequestError(
                        f"{what} {i}: {at:#x} is mapped {perms[k]!r} in engine process {self.pid}; "
                        "a KV buffer must be readable and writable"
                    )
                at = ends[k]
        probe = np.zeros(1, dtype=np.uint8)
        for address, _ in ranges:
            try:
                read_iov(
                    self.pid,
                    np.array([[probe.ctypes.data, 1]], dtype=np.uint64),
                    np.array([[address, 1]], dtype=np.uint64),
                )
            except PermissionError:
                raise PermissionDeniedError(self._unreachable("the kernel refused to read its memory")) from None
            except OSError as exc:
                raise InvalidRequestError(f"cannot read engine process {self.pid} at {address:#x}: {exc}") from None
        self.check()  # the maps read above were this process's

    def probe(self, ends: np.ndarray) -> None:
        """Raise unless the one-byte ranges ``ends`` (:func:`range_ends`) can still be read, in
        one system call: memory the engine unmapped or freed after registering it is refused
        when it is offered, not when a pull reads it."""
        self.check()
        scratch = np.empty(len(ends), dtype=np.uint8)
        try:
            read_iov(self.pid, np.array([[scratch.ctypes.data, len(ends)]], dtype=np.uint64), ends)
        except OSError as exc:
            raise InvalidRequestError(
                f"engine process {self.pid} no longer maps all of this pool's memory ({exc.strerror}): it freed or "
                "unmapped a registered tensor; deregister a pool before freeing its memory"
            ) from None

    def _mappings(self) -> tuple[list[int], list[int], list[str]]:
        try:
            with open(f"/proc/{self.pid}/maps") as f:
                lines = f.read().splitlines()
        except PermissionError:
            raise PermissionDeniedError(self._unreachable("its /proc/<pid>/maps is not readable")) from None
        except OSError as exc:
            raise UnavailableError(f"cannot read the mappings of engine process {self.pid}: {exc}") from None
        starts, ends, perms = [], [], []
        for line in lines:
            fields = line.split(maxsplit=5)
            lo, hi = fields[0].split("-")
            path = fields[5] if len(fields) > 5 else ""
            if path in ("[vvar]", "[vdso]", "[vsyscall]", "[vvar_vclock]"):
                continue
            starts.append(int(lo, 16))
            ends.append(int(hi, 16))
            perms.append(fields[1])
        return starts, ends, perms

    def _unreachable(self, why: str) -> str:
        me = os.getuid()
        users = f"kvxferd runs as uid {me}, the engine as uid {self.uid}"
        hint = (
            "the kernel lets one process read another's memory only as the same user or with "
            "CAP_SYS_PTRACE (and, under Yama ptrace_scope 1, when the engine allows it: kvxfer_client does)"
        )
        return f"kvxferd cannot reach engine process {self.pid}'s memory: {why} ({users}; {hint}): {_SHARED_MEMORY_FIX}"


def range_ends(addresses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The first and last byte of each ``(address, size)`` range, as one-byte remote iovecs
    (what :meth:`EngineProcess.probe` reads).

    >>> range_ends(np.array([4096, 8192]), np.array([16, 8])).tolist()
    [[4096, 1], [4111, 1], [8192, 1], [8199, 1]]
    """
    ends = np.empty((2 * len(addresses), 2), dtype=np.uint64)
    ends[0::2, 0], ends[1::2, 0], ends[:, 1] = addresses, addresses + sizes - 1, 1
    return ends


def attach_peer(conn: socket.socket) -> EngineProcess:
    """The process at the other end of ``conn`` (a connected Unix socket), pinned by a pidfd."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        if pid <= 0:
            raise InvalidRequestError("the fd socket's peer has no process id (is it in another pid namespace?)")
        pidfd = _peer_pidfd(conn, pid, uid)
    except OSError as exc:
        raise UnavailableError(f"cannot identify the process on the fd socket: {exc}") from None
    process = EngineProcess(pid, pidfd, uid)
    if process.exited():
        os.close(pidfd)
        raise UnavailableError(f"the engine process {pid} exited before it could attach")
    return process


def _peer_pidfd(conn: socket.socket, pid: int, uid: int) -> int:
    """A pidfd for the peer: from the kernel's record of who connected where it has one, else
    opened by pid and checked to belong to the connecting user (a pid reused by another user's
    process between connect and now is refused)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno not in (errno.ENOPROTOOPT, errno.EINVAL):
            raise
    else:
        return int(raw)
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise UnavailableError(f"the engine process {pid} exited before it could attach") from None
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        owner = -1
    if owner != uid:
        os.close(pidfd)
        raise PermissionDeniedError(f"pid {pid} no longer belongs to the process that connected")
    return pidfd
