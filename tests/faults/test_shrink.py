"""An engine shrinks the memory it registered: the daemon lives, and only the owner hears of it.

Shared-memory pools are mapped by the daemon, so a file that shrank under it would be SIGBUS
at its next touch (offer sums, sends, direct reads, copies, tier stores). The daemon maps only
files sealed against shrinking: the engine's ``ftruncate`` itself is refused, and every path
goes on byte-exact. Files that could shrink are refused at registration. Process pools are
read through the kernel (``process_vm_readv/writev``): memory the engine unmapped is a typed
error for its own calls, and nothing for anyone else's.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

import numpy as np
import pytest

from bench.cluster import Cluster
from bench.engine import blocks_of
from kvxfer_client import AsyncKvxferClient, HostBuffer, InvalidRequestError, KvxferError, Layout

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=16, block_bytes=16 << 10)


def _filled(seed: int) -> list[HostBuffer]:
    bufs = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    for i, buf in enumerate(bufs):
        buf.array()[:] = np.random.default_rng((seed, i)).integers(0, 256, buf.size, dtype=np.uint8)
    return bufs


def _memfd_buffer(size: int, seals: int = 0) -> HostBuffer:
    """A memfd the engine did not seal against shrinking (``seals``: what it did seal)."""
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    prot = mmap.PROT_READ | (0 if seals & fcntl.F_SEAL_WRITE else mmap.PROT_WRITE)
    return HostBuffer("", size, mmap.mmap(fd, size, prot=prot), owner=False, fd=fd)


async def test_a_shared_memory_pool_cannot_shrink_and_every_path_goes_on(cluster: Cluster) -> None:
    """The owner's ``ftruncate`` of its registered buffer is refused by the kernel; offers,
    local pulls, remote pulls (UCX and direct reads) and tier stores of that pool go on."""
    a, b = cluster.daemon("a", "--tier-host-bytes", str(8 << 20)), cluster.daemon("b")
    owner = await AsyncKvxferClient(a.socket, engine_name="owner").connect()
    local = await AsyncKvxferClient(a.socket, engine_name="local").connect()
    remote = await AsyncKvxferClient(b.socket, engine_name="remote").connect()
    try:
        src_bufs = _filled(1)
        src = await owner.register_pool(src_bufs, LAYOUT)
        early = await owner.offer(src, [1, 2])  # made before the attempt: its sums and sends run after
        for buf in src_bufs:
            with pytest.raises(PermissionError):
                os.ftruncate(buf.fd, 0)
        local_bufs, remote_bufs = _filled(2), _filled(3)
        dst_local = await local.register_pool(local_bufs, LAYOUT)
        dst_remote = await remote.register_pool(remote_bufs, LAYOUT)
        await remote.pull(early, dst_remote, [3, 4])
        await local.pull(await owner.offer(src, [5]), dst_local, [6])
        await owner.tier_store(src, [7], [b"k" * 16])
        assert blocks_of(LAYOUT, remote_bufs, [3, 4]) == blocks_of(LAYOUT, src_bufs, [1, 2])
        assert blocks_of(LAYOUT, local_bufs, [6]) == blocks_of(LAYOUT, src_bufs, [5])
        assert a.proc is not None and a.proc.poll() is None and b.proc is not None and b.proc.poll() is None
    finally:
        for c in (owner, local, remote):
            await c.close()


async def test_memory_that_could_shrink_is_refused_or_sealed_at_registration(cluster: Cluster) -> None:
    """A ``/dev/shm`` file (cannot be sealed) and a memfd closed to new seals are refused,
    typed, naming the fix; an unsealed memfd that allows sealing is sealed by the daemon (the
    engine's later ``ftruncate`` is refused)."""
    a = cluster.daemon("a")
    engine = await AsyncKvxferClient(a.socket, engine_name="e").connect()
    size = LAYOUT.buffer_sizes()[0]
    layout = Layout.paged_kv(num_layers=1, num_blocks=16, block_bytes=16 << 10)
    assert layout.buffer_sizes() == [size]
    try:
        for bad in (HostBuffer.create(size, named=True), _memfd_buffer(size, fcntl.F_SEAL_SEAL)):
            with pytest.raises(InvalidRequestError, match=r"HostBuffer\.create"):
                await engine.register_pool([bad], layout)
            bad.close()
        sealed = _memfd_buffer(size, fcntl.F_SEAL_WRITE)  # the daemon could never write pulls into it
        with pytest.raises(InvalidRequestError, match="sealed against writes"):
            await engine.register_pool([sealed], layout)
        sealed.close()
        loose = _memfd_buffer(size)
        await engine.register_pool([loose], layout)
        with pytest.raises(PermissionError):
            os.ftruncate(loose.fd, 0)
        assert fcntl.fcntl(loose.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    finally:
        await engine.close()


async def test_a_process_pool_whose_memory_the_engine_unmapped_fails_only_its_owners_calls(cluster: Cluster) -> None:
    """The engine unmaps the CPU memory it registered as it is: an offer made after is refused
    (typed, naming the fix), a pull of one made before fails typed; the daemon lives and another
    engine's handoff is byte-exact beside it."""
    a = cluster.daemon("a", "--integrity", "full")
    owner = await AsyncKvxferClient(a.socket, engine_name="owner").connect()
    other = await AsyncKvxferClient(a.socket, engine_name="other").connect()
    try:
        size = LAYOUT.buffer_sizes()[0]
        region = mmap.mmap(-1, size * len(LAYOUT.buffer_sizes()))
        arrays = [np.frombuffer(region, dtype=np.uint8, count=size, offset=i * size) for i in range(2)]
        for i, array in enumerate(arrays):  # not zeros: fresh memory at these addresses would match
            array[:] = np.random.default_rng((3, i)).integers(0, 256, size, dtype=np.uint8)
        src = await owner.register_pool(arrays, LAYOUT)
        ticket = await owner.offer(src, [1])
        _unmap_in_place(arrays[0].ctypes.data, len(region))
        dst_bufs = _filled(4)
        dst = await other.register_pool(dst_bufs, LAYOUT)
        with pytest.raises(InvalidRequestError, match="no longer maps"):  # refused when offered, not at pull
            await owner.offer(src, [2])
        with pytest.raises(KvxferError):
            await other.pull(ticket, dst, [3])
        good_bufs = _filled(5)
        good = await other.register_pool(good_bufs, LAYOUT)
        await other.pull(await other.offer(good, [8]), dst, [9])
        assert blocks_of(LAYOUT, dst_bufs, [9]) == blocks_of(LAYOUT, good_bufs, [8])
        assert a.proc is not None and a.proc.poll() is None
    finally:
        await owner.close()
        await other.close()


def _unmap_in_place(address: int, length: int) -> None:
    """What ``munmap`` does to the pages (their contents are gone, any access faults), but the
    addresses stay taken: after a real ``munmap`` the next allocation of this process could be
    placed there and a read of them succeed, and ``mmap``'s own close would unmap that later."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot_none, map_fixed = 0, 0x10  # Linux's values (Python's mmap module names neither)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_fixed  # replaces what is there, at once
    assert libc.mmap(ctypes.c_void_p(address), ctypes.c_size_t(length), prot_none, flags, -1, 0) == address
