"""Host buffers: shared memory the daemon maps, on huge pages where the system allows them."""

from __future__ import annotations

import pytest

from kvxfer_client import HostBuffer

TWO_MIB = 2 << 20


def _memfds_allow_huge_pages() -> bool:
    """Host buffers are memfds, on the kernel's internal shmem mount: ``shmem_enabled``
    (``[advise]`` or more) rules whether a mapping may ask for huge pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as fh:
            chosen = fh.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return False
    return chosen in {"advise", "always", "within_size", "force"}


def _pmd_mapped_kib(address: int) -> int:
    """``ShmemPmdMapped`` of the mapping of this process that starts at ``address``."""
    with open("/proc/self/smaps") as fh:
        inside = False
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == "ShmemPmdMapped:":
                return int(line.split()[1])
    raise AssertionError("mapping not found")


def _address(buf: HostBuffer) -> int:
    return int(buf.array().__array_interface__["data"][0])


@pytest.mark.skipif(not _memfds_allow_huge_pages(), reason="shmem_enabled allows no huge pages for memfds")
def test_buffers_sit_on_huge_pages_on_both_sides_when_shmem_allows_them() -> None:
    """Copies between processes walk both sides' pages: 2 MiB pages make that walk short."""
    buf = HostBuffer.create(8 * TWO_MIB)
    try:
        peer = HostBuffer.map_fd(buf.fd, buf.size, "peer")
        try:
            assert _pmd_mapped_kib(_address(buf)) >= 4 * 2048
            assert _pmd_mapped_kib(_address(peer)) >= 4 * 2048
        finally:
            peer.close()
    finally:
        buf.close()


def test_buffers_are_zero_filled_and_shared_between_mappings() -> None:
    buf = HostBuffer.create(TWO_MIB + 4096)  # not a multiple of a huge page
    try:
        arr = buf.array()
        assert not arr.any()
        arr[-1] = 7
        peer = HostBuffer.map_fd(buf.fd, buf.size, "peer")
        try:
            assert peer.array()[-1] == 7
        finally:
            peer.close()
    finally:
        buf.close()


def _mappings_of(name: str) -> int:
    with open("/proc/self/maps") as fh:
        return sum(1 for line in fh if line.rstrip().endswith("/dev/shm/" + name))


def test_detaching_a_mapping_with_live_views_releases_the_shared_memory_and_keeps_the_views_safe() -> None:
    """What the daemon does to a deregistered pool that a UCX receive still points into."""
    buf = HostBuffer.create(TWO_MIB, named=True)
    try:
        buf.array()[:] = 5
        daemon_side = HostBuffer.map_fd(buf.fd, buf.size, "pool")
        view = daemon_side.array()  # held, as an unconfirmed receive holds the pool's views
        assert _mappings_of(buf.name) == 2
        daemon_side.close(detach=True)
        assert _mappings_of(buf.name) == 1  # only the engine's own mapping is left
        assert view[0] == 0  # private zero pages now, not the engine's memory
        view[:] = 9  # a late write lands there, not in the engine's memory (and does not fault)
        assert buf.array().max() == 5
    finally:
        buf.close()
