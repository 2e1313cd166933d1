"""The engine's own CPU memory as kvxfer buffers: numpy arrays, torch CPU tensors, anything
with ``__array_interface__`` or a DLPack CPU device.

Nothing is copied and nothing is shared by name: the buffer is described by its address and
length in this process, and the daemon reaches it through the kernel (``process_vm_readv`` /
``process_vm_writev``) after this process attached itself to the session on the fd socket.
The daemon learns who we are from the socket's peer credentials, checks each range against
our mappings, and can do nothing the kernel would not let it do to us anyway.

The engine keeps the tensors alive (and does not resize them) until the pool is deregistered,
as with GPU tensors. Under Yama ``ptrace_scope`` 1, the kernel lets only a process we name
read our memory: :func:`allow_daemon` names the daemon.

>>> import numpy as np
>>> a = np.zeros((4, 256), dtype=np.float16)
>>> host_tensor_extent(a) == (a.ctypes.data, a.nbytes)
True
>>> host_tensor_extent(np.zeros(4)[::2])
Traceback (most recent call last):
...
kvxfer_client.InvalidRequestError: a buffer must be a contiguous tensor (call .contiguous() first)
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from kvxfer.dlpack import KDL_CPU, KDL_CUDA_HOST, NOT_CONTIGUOUS, c_contiguous, dlpack_extent
from kvxfer.errors import InvalidRequestError

__all__ = ["advise_huge_pages", "allow_daemon", "host_tensor_extent", "is_host_tensor"]

_YAMA = "/proc/sys/kernel/yama/ptrace_scope"
_PR_SET_PTRACER = 0x59616D61
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1
_HUGE_PAGE = 2 << 20


def is_host_tensor(obj: Any) -> bool:
    """Whether ``obj`` is CPU memory kvxfer can register as it is."""
    if hasattr(obj, "__array_interface__"):
        return True
    device = getattr(obj, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return int(device()[0]) in (KDL_CPU, KDL_CUDA_HOST)
    except Exception:  # noqa: BLE001 - a failing probe means "not a host tensor"
        return False


def host_tensor_extent(obj: Any) -> tuple[int, int]:
    """``(address, bytes)`` of a contiguous, writable CPU tensor in this process."""
    if hasattr(obj, "__array_interface__"):
        face = obj.__array_interface__
        address, readonly = face["data"]
        shape = tuple(int(s) for s in face["shape"])
        itemsize = np.dtype(face["typestr"]).itemsize
        strides = face.get("strides")
        if strides is not None and not c_contiguous(shape, tuple(int(s) for s in strides), itemsize):
            raise InvalidRequestError(NOT_CONTIGUOUS)
        if readonly:
            raise InvalidRequestError("a buffer must be writable (this array is read-only)")
        ptr, size = int(address or 0), math.prod(shape) * itemsize
    else:
        device, ptr, size = dlpack_extent(obj)
        if device not in (KDL_CPU, KDL_CUDA_HOST):
            raise InvalidRequestError(f"DLPack tensor is on device type {device}, not in host memory")
    if size <= 0 or ptr <= 0:
        raise InvalidRequestError("a buffer must not be empty")
    return ptr, size


def advise_huge_pages(address: int, size: int) -> int:
    """Ask for transparent huge pages on the whole 2 MiB pages inside ``[address, address +
    size)``, now (``MADV_COLLAPSE``) and for later faults (``MADV_HUGEPAGE``); returns the bytes
    advised (0 where the kernel declines: THP off, an old kernel, memory short).

    The daemon reaches this memory with ``process_vm_readv/writev``, which walk it page by
    page: a 32 KiB-segment copy ran at 4.3 GB/s over 4 KiB pages and 6.5 GB/s over huge pages
    here, and a local handoff out of torch CPU tensors (torch does not ask for huge pages;
    numpy does for large arrays) went from 0.50 to 0.66 of shared memory's speed (b16 through
    one daemon, 7 interleaved rounds of ``python -m bench.process_memory --memory torch``).
    """
    lo = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    hi = (address + size) // _HUGE_PAGE * _HUGE_PAGE
    if hi <= lo:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    start, length = ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo)
    if libc.madvise(start, length, _MADV_HUGEPAGE) != 0:
        return 0
    libc.madvise(start, length, _MADV_COLLAPSE)  # best effort: khugepaged collapses later otherwise
    return hi - lo


def allow_daemon(daemon_pid: int) -> None:
    """Under Yama ``ptrace_scope`` 1, let the daemon (only it) reach this process's memory.

    Yama then allows a process's memory to be read only by its ancestors and the one process
    it names; naming the daemon replaces an earlier name (a debugger's). Scopes 2 and 3 allow
    it to no process without ``CAP_SYS_PTRACE``: the daemon's refusal says so.
    """
    try:
        with open(_YAMA) as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return  # no Yama: the kernel's usual same-user rule applies
    if scope == 1:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(daemon_pid), 0, 0, 0) != 0:
            raise InvalidRequestError(f"cannot allow kvxferd (pid {daemon_pid}) to read this process's memory")
