"""GPU memory of the engines, opened in the daemon through legacy CUDA IPC handles.

One handle maps a whole allocation, and the tensors of one engine often share allocations
(torch's caching allocator carves many tensors out of one ``cudaMalloc``), so mappings are
cached per (GPU, handle) and reference-counted: a pool's buffers are views at the offsets the
engine gave, bounds-checked against the allocation size the driver reports for the mapping.

CuPy is imported only here and in the GPU data plane: a CPU-only daemon never loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxfer.cuda import IPC_HANDLE_BYTES, driver
from kvxfer.errors import InvalidRequestError, KvxferError, UnavailableError
from kvxfer.proto import common_pb2

__all__ = ["GpuBuffer", "IpcMappings", "gpu_support"]


def gpu_support() -> str:
    """Empty when this daemon can map GPU memory, else why not."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no GPU is visible to kvxferd"
        driver()
    except ImportError:
        return "CuPy is not installed (install kvxfer[cu12] or kvxfer[cu13])"
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means no GPU support
        return f"CUDA is not usable: {exc}"
    return ""


@dataclass
class _Mapping:
    device: int
    base: int
    size: int
    refs: int = 0


@dataclass(frozen=True)
class GpuBuffer:
    """One registered GPU buffer: ``size`` bytes at ``ptr`` (inside a cached mapping)."""

    key: tuple[str, bytes]
    device: int
    ptr: int
    size: int
    array: Any  # cupy uint8 view of the buffer


class IpcMappings:
    """The daemon's open IPC mappings, shared by every pool that uses an allocation."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, bytes], _Mapping] = {}

    @property
    def count(self) -> int:
        return len(self._open)

    def map(self, spec: common_pb2.BufferSpec) -> GpuBuffer:
        import cupy

        handle = bytes(spec.cuda_ipc_handle)
        if len(handle) != IPC_HANDLE_BYTES:
            raise InvalidRequestError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        if not spec.gpu_uuid.startswith("GPU-") or len(spec.gpu_uuid) > 64:
            raise InvalidRequestError(f"malformed GPU UUID {spec.gpu_uuid[:64]!r}")
        cu = driver()
        device = cu.ordinal_of(spec.gpu_uuid)
        key = (spec.gpu_uuid, handle)
        m = self._open.get(key)
        if m is None:
            try:
                with cupy.cuda.Device(device):
                    base = int(
                        cupy.cuda.runtime.ipcOpenMemHandle(handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
                    )
                with cu.context(device):
                    _, size = cu.address_range(base)
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise InvalidRequestError(
                    f"cannot open the CUDA IPC handle on {spec.gpu_uuid}: {exc} (the engine must be another "
                    "process on this node, and the memory a cudaMalloc allocation)"
                ) from None
            except KvxferError:
                raise
            m = self._open[key] = _Mapping(device, base, size)
        if spec.cuda_alloc_offset + spec.size > m.size:
            if m.refs == 0:
                self._close(key)
            raise InvalidRequestError(
                f"GPU buffer of {spec.size} bytes at offset {spec.cuda_alloc_offset} runs past its "
                f"{m.size}-byte allocation"
            )
        m.refs += 1
        ptr = m.base + spec.cuda_alloc_offset
        with cupy.cuda.Device(device):
            mem = cupy.cuda.UnownedMemory(ptr, spec.size, self, device_id=device)
            array = cupy.ndarray((spec.size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return GpuBuffer(key, device, ptr, spec.size, array)

    def unmap(self, buf: GpuBuffer) -> None:
        m = self._open.get(buf.key)
        if m is None:
            return
        m.refs -= 1
        if m.refs <= 0:
            self._close(buf.key)

    def _close(self, key: tuple[str, bytes]) -> None:
        import cupy

        m = self._open.pop(key)
        try:
            with cupy.cuda.Device(m.device):
                cupy.cuda.runtime.ipcCloseMemHandle(m.base)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise UnavailableError(f"closing a CUDA IPC mapping failed: {exc}") from None


def register_host(ptr: int, size: int) -> None:
    """Pin a host mapping and make it addressable from kernels (unified addressing)."""
    import cupy

    # cudaHostRegisterPortable | cudaHostRegisterMapped: every context, device-visible.
    cupy.cuda.runtime.hostRegister(ptr, size, 3)


def unregister_host(ptr: int) -> None:
    import cupy

    try:
        cupy.cuda.runtime.hostUnregister(ptr)
    except cupy.cuda.runtime.CUDARuntimeError:
        pass


def init_cuda() -> list[str]:
    """Create the CUDA context of GPU 0 on this thread before UCX starts (UCX's CUDA transports
    bind to the context current when the worker is made); returns the visible GPUs' UUIDs, or
    nothing when this daemon has no GPU support."""
    if gpu_support():
        return []
    import cupy

    with cupy.cuda.Device(0):
        cupy.cuda.runtime.free(0)  # forces the primary context into existence
    cupy.cuda.Device(0).use()
    cu = driver()
    return [cu.device_uuid(i) for i in range(cu.device_count())]
