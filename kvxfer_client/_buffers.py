"""One engine buffer as the daemon's ``BufferSpec``: shared memory (its descriptor goes on the fd
socket), a CPU tensor the engine owns (its address in this process), or a GPU tensor (its
CUDA IPC handle). The kind is decided here, once, for every registration.
"""

from __future__ import annotations

from typing import Any

from kvxfer.cuda import describe_cuda_tensor, is_cuda_tensor
from kvxfer.errors import InvalidRequestError
from kvxfer.host_memory import HostBuffer
from kvxfer.proto import common_pb2

from ._config import huge_pages_enabled
from ._host_tensor import advise_huge_pages, host_tensor_extent, is_host_tensor

__all__ = ["buffer_spec"]


def buffer_spec(buf: Any, advise: bool = True) -> common_pb2.BufferSpec:
    """A :class:`HostBuffer`, a CPU tensor or a GPU tensor as the daemon's ``BufferSpec``;
    ``advise``: ask for huge pages under a CPU tensor (not again when registering it again:
    collapsing a 1 GiB KV cache took over 20 s on a loaded machine, and the pages stay huge)."""
    if isinstance(buf, HostBuffer):
        return common_pb2.BufferSpec(kind=common_pb2.MEMORY_KIND_HOST_SHM, size=buf.size)
    if not is_cuda_tensor(buf):
        if not is_host_tensor(buf):
            raise InvalidRequestError(
                f"a {type(buf).__name__} is not a buffer kvxfer can register: pass HostBuffer objects, CPU tensors "
                "(numpy, torch: __array_interface__ or DLPack) or GPU tensors (__cuda_array_interface__ or DLPack)"
            )
        address, size = host_tensor_extent(buf)
        if advise and huge_pages_enabled():
            advise_huge_pages(address, size)
        return common_pb2.BufferSpec(kind=common_pb2.MEMORY_KIND_HOST_PROCESS, size=size, process_address=address)
    spec = describe_cuda_tensor(buf)
    return common_pb2.BufferSpec(
        kind=common_pb2.MEMORY_KIND_CUDA_IPC,
        size=spec.size,
        cuda_ipc_handle=spec.ipc_handle,
        cuda_alloc_offset=spec.alloc_offset,
        gpu_uuid=spec.gpu_uuid,
    )
