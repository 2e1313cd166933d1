"""Where a DLPack tensor's bytes are: its device type, first byte and length (ctypes only).

torch exposes no ``__array_interface__`` for CPU tensors nor ``__cuda_array_interface__`` for
bfloat16 GPU tensors; DLPack (``__dlpack__``) covers both, and numpy, CuPy and JAX too.
Only C-contiguous tensors are accepted: a pool buffer is one byte range.

>>> import numpy as np
>>> a = np.arange(6, dtype=np.float32).reshape(2, 3)
>>> device, ptr, nbytes = dlpack_extent(a)
>>> (device == KDL_CPU, ptr == a.ctypes.data, nbytes)
(True, True, 24)
>>> dlpack_extent(a.T)
Traceback (most recent call last):
...
kvxfer_client.InvalidRequestError: a buffer must be a contiguous tensor (call .contiguous() first)
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

from .errors import InvalidRequestError

__all__ = [
    "KDL_CPU",
    "KDL_CUDA",
    "KDL_CUDA_HOST",
    "KDL_CUDA_MANAGED",
    "c_contiguous",
    "dlpack_extent",
    "dlpack_geometry",
]

#: DLPack device types (dlpack.h ``DLDeviceType``).
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_CUDA_MANAGED = 13

NOT_CONTIGUOUS = "a buffer must be a contiguous tensor (call .contiguous() first)"


def c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether byte ``strides`` describe a C-contiguous tensor of ``shape``."""
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    """``DLTensor`` (dlpack.h), the first member of the legacy ``DLManagedTensor``."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def dlpack_geometry(obj: Any) -> tuple[int, int, tuple[int, ...], tuple[int, ...], int]:
    """``(device type, address of the first element, shape, strides in bytes, item size)`` of a
    DLPack tensor (strides are C-contiguous ones when the producer leaves them out)."""
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    # The capsule keeps its name: when it is garbage collected, its destructor calls the
    # producer's deleter, and the engine's own reference keeps the memory alive.
    t = _DLTensor.from_address(get(capsule, b"dltensor"))
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    itemsize = t.dtype.bits * t.dtype.lanes // 8
    if t.strides:
        strides = tuple(int(t.strides[i]) * itemsize for i in range(t.ndim))
    else:
        strides = tuple(itemsize * math.prod(shape[i + 1 :]) for i in range(t.ndim))
    return int(t.device.device_type), int(t.data or 0) + int(t.byte_offset), shape, strides, itemsize


def dlpack_extent(obj: Any) -> tuple[int, int, int]:
    """``(device type, address of the first byte, bytes)`` of a contiguous DLPack tensor."""
    device, ptr, shape, strides, itemsize = dlpack_geometry(obj)
    if not c_contiguous(shape, strides, itemsize):
        raise InvalidRequestError(NOT_CONTIGUOUS)
    return device, ptr, math.prod(shape) * itemsize
