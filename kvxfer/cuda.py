"""GPU tensors as kvxfer buffers, through the CUDA driver API (ctypes; no torch, no CuPy).

A GPU buffer crosses the engine socket as the *legacy* CUDA IPC handle of the allocation
that holds the tensor, the tensor's byte offset inside that allocation
(``cuMemGetAddressRange``) and the GPU's UUID (ordinals differ between processes with
different ``CUDA_VISIBLE_DEVICES``). The daemon opens the handle, which maps the whole
allocation, and adds the offset. No address crosses the socket.

Any object exposing ``__cuda_array_interface__`` (CuPy, torch, Numba) or DLPack
(``__dlpack__``, e.g. torch bfloat16 tensors, JAX) is accepted; it must be contiguous.

>>> is_cuda_tensor(object())
False
>>> describe_cuda_tensor(object())
Traceback (most recent call last):
...
kvxfer_client.InvalidRequestError: object is not a GPU tensor ...
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .dlpack import KDL_CUDA, KDL_CUDA_MANAGED, NOT_CONTIGUOUS, c_contiguous, dlpack_extent
from .errors import InvalidRequestError, UnavailableError

__all__ = ["CudaDriver", "CudaTensorSpec", "describe_cuda_tensor", "driver", "format_uuid", "is_cuda_tensor"]

IPC_HANDLE_BYTES = 64
_ATTR_DEVICE_ORDINAL = 9
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10

VMM_HINT = (
    "the tensor's memory has no legacy CUDA IPC handle (CUDA VMM / cuMemCreate, e.g. torch with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): allocate the KV cache with cudaMalloc "
    "(unset expandable_segments for the engine, or allocate the pool before enabling it)"
)


@dataclass(frozen=True)
class CudaTensorSpec:
    """What the daemon needs to map one GPU tensor (see ``BufferSpec`` in common.proto)."""

    ipc_handle: bytes
    alloc_offset: int
    size: int
    gpu_uuid: str
    device_ordinal: int  # this process's ordinal, for messages only


def format_uuid(raw: bytes) -> str:
    """16 UUID bytes as the ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` form nvidia-smi prints.

    >>> format_uuid(bytes(range(16)))
    'GPU-00010203-0405-0607-0809-0a0b0c0d0e0f'
    """
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaDriver:
    """The few driver calls kvxfer needs, each checked; ``UnavailableError`` without a driver."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise UnavailableError(f"no CUDA driver in this process (libcuda.so.1: {exc})") from None
        self._lib = lib
        u64, c_int, vp = ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p
        sigs: dict[str, list[Any]] = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGetCount": [ctypes.POINTER(c_int)],
            "cuDeviceGet": [ctypes.POINTER(c_int), c_int],
            "cuPointerGetAttribute": [vp, c_int, u64],
            "cuMemGetAddressRange_v2": [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64],
            "cuIpcGetMemHandle": [ctypes.c_char_p, u64],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), c_int],
            "cuDevicePrimaryCtxRelease_v2": [c_int],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(vp)],
            "cuGetErrorString": [c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = c_int
        uuid_fn = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
        uuid_fn.argtypes = [ctypes.c_char_p, c_int]
        uuid_fn.restype = c_int
        self._uuid_fn = uuid_fn
        self._lock = threading.Lock()
        self._check(lib.cuInit(0), "cuInit")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self._lib.cuGetErrorString(rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else f"CUresult {rc}"
            raise UnavailableError(f"{what} failed: {text}")

    def device_count(self) -> int:
        n = ctypes.c_int()
        self._check(self._lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def device_uuid(self, ordinal: int) -> str:
        dev = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        raw = ctypes.create_string_buffer(16)
        self._check(self._uuid_fn(raw, dev.value), "cuDeviceGetUuid")
        return format_uuid(raw.raw)

    def ordinal_of(self, gpu_uuid: str) -> int:
        """This process's ordinal of the GPU with ``gpu_uuid``."""
        for i in range(self.device_count()):
            if self.device_uuid(i) == gpu_uuid:
                return i
        raise InvalidRequestError(f"GPU {gpu_uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")

    def pointer_device(self, ptr: int) -> int:
        out = ctypes.c_int()
        self._check(
            self._lib.cuPointerGetAttribute(ctypes.byref(out), _ATTR_DEVICE_ORDINAL, ptr),
            "cuPointerGetAttribute(DEVICE_ORDINAL) (is this device memory?)",
        )
        return out.value

    @contextmanager
    def context(self, ordinal: int) -> Iterator[None]:
        """The device's primary context (the one torch and CuPy use) made current."""
        ctx = ctypes.c_void_p()
        with self._lock:
            self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal), "cuDevicePrimaryCtxRetain")
            self._check(self._lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            with self._lock:
                self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
                self._lib.cuDevicePrimaryCtxRelease_v2(ordinal)

    def address_range(self, ptr: int) -> tuple[int, int]:
        """``(base, size)`` of the allocation containing ``ptr`` (a context must be current)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange"
        )
        return base.value, size.value

    def legacy_ipc_capable(self, ptr: int) -> bool:
        out = ctypes.c_int()
        rc = self._lib.cuPointerGetAttribute(ctypes.byref(out), _ATTR_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)
        return rc != 0 or bool(out.value)  # drivers without the attribute only have legacy memory

    def ipc_handle(self, base: int) -> bytes:
        raw = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._check(self._lib.cuIpcGetMemHandle(raw, base), "cuIpcGetMemHandle")
        return raw.raw


_DRIVER: CudaDriver | None = None
_DRIVER_LOCK = threading.Lock()


def driver() -> CudaDriver:
    """The process's :class:`CudaDriver`, loaded on first use."""
    global _DRIVER
    with _DRIVER_LOCK:
        if _DRIVER is None:
            _DRIVER = CudaDriver()
        return _DRIVER


def is_cuda_tensor(obj: Any) -> bool:
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    device = getattr(obj, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return int(device()[0]) in (KDL_CUDA, KDL_CUDA_MANAGED)
    except Exception:  # noqa: BLE001 - a failing probe means "not a GPU tensor"
        return False


def _from_cuda_array_interface(obj: Any) -> tuple[int, int]:
    import numpy as np

    cai = obj.__cuda_array_interface__
    shape = tuple(int(s) for s in cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is not None and not c_contiguous(shape, tuple(int(s) for s in strides), itemsize):
        raise InvalidRequestError(NOT_CONTIGUOUS)
    return int(cai["data"][0]), math.prod(shape) * itemsize


def _from_dlpack(obj: Any) -> tuple[int, int]:
    device, ptr, size = dlpack_extent(obj)
    if device not in (KDL_CUDA, KDL_CUDA_MANAGED):
        raise InvalidRequestError(f"DLPack tensor is on device type {device}, not CUDA")
    return ptr, size


def describe_cuda_tensor(obj: Any) -> CudaTensorSpec:
    """The IPC handle, allocation offset, size and GPU UUID of a contiguous GPU tensor."""
    if hasattr(obj, "__cuda_array_interface__"):
        try:
            ptr, size = _from_cuda_array_interface(obj)
        except (TypeError, AttributeError, RuntimeError, ValueError) as exc:
            if isinstance(exc, InvalidRequestError) or not hasattr(obj, "__dlpack__"):
                raise
            ptr, size = _from_dlpack(obj)  # torch has no interface for bfloat16: DLPack has
    elif is_cuda_tensor(obj):
        ptr, size = _from_dlpack(obj)
    else:
        raise InvalidRequestError(
            "object is not a GPU tensor (no __cuda_array_interface__, or DLPack on a CUDA device)"
        )
    if size <= 0:
        raise InvalidRequestError("a GPU buffer must not be empty")
    cu = driver()
    ordinal = cu.pointer_device(ptr)
    with cu.context(ordinal):
        if not cu.legacy_ipc_capable(ptr):
            raise InvalidRequestError(VMM_HINT)
        base, alloc_size = cu.address_range(ptr)
        if ptr + size > base + alloc_size:
            raise InvalidRequestError("the tensor extends past the end of its allocation")
        handle = cu.ipc_handle(base)
        uuid = cu.device_uuid(ordinal)
    return CudaTensorSpec(handle, ptr - base, size, uuid, ordinal)
