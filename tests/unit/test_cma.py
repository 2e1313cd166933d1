"""The kernel's scatter-gather copy (process_vm_readv on the daemon itself): the byte stream
of one (address, length) list lands in another, whatever their piece boundaries."""

from __future__ import annotations

import errno
import mmap

import numpy as np
import pytest

from kvxferd.dataplane.cma import IOV_MAX, copy_iov, self_copy_works

pytestmark = pytest.mark.skipif(not self_copy_works(), reason="process_vm_readv on this process is refused here")


def pieces(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    rows = np.empty((len(offsets), 2), dtype=np.uint64)
    rows[:, 0] = buf.ctypes.data + offsets
    rows[:, 1] = lengths
    return rows


def test_pieces_of_different_sizes_on_each_side_over_many_calls() -> None:
    rng = np.random.default_rng(3)
    # 5000 source pieces of 1..9 bytes and destination pieces of 1..13 bytes, in shuffled
    # slots: several calls of IOV_MAX entries, most ending inside an entry.
    src_len = rng.integers(1, 10, 5000)
    total = int(src_len.sum())
    dst_len = rng.integers(1, 14, total)  # more than enough; trimmed to the total below
    dst_len = dst_len[: int(np.searchsorted(np.cumsum(dst_len), total)) + 1]
    dst_len[-1] -= int(dst_len.sum()) - total
    assert len(src_len) > 4 * IOV_MAX and int(dst_len.sum()) == total

    src = rng.integers(0, 256, 16 * len(src_len), dtype=np.uint8)
    dst = np.zeros(16 * len(dst_len), dtype=np.uint8)
    src_off = rng.permutation(len(src_len)) * 16
    dst_off = rng.permutation(len(dst_len)) * 16
    copy_iov(pieces(dst, dst_off, dst_len), pieces(src, src_off, src_len))

    stream = np.concatenate([src[o : o + n] for o, n in zip(src_off, src_len, strict=True)])
    landed = np.concatenate([dst[o : o + n] for o, n in zip(dst_off, dst_len, strict=True)])
    np.testing.assert_array_equal(landed, stream)
    untouched = np.ones(len(dst), dtype=bool)
    for o, n in zip(dst_off, dst_len, strict=True):
        untouched[o : o + n] = False
    assert not dst[untouched].any(), "bytes outside the destination pieces were written"


def test_sides_of_unequal_length_are_refused_before_any_byte_moves() -> None:
    src = np.arange(10, dtype=np.uint8)
    dst = np.zeros(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="differ in length"):
        copy_iov(pieces(dst, np.array([0]), np.array([4])), pieces(src, np.array([0]), np.array([5])))
    assert not dst.any()


def test_an_unmapped_source_is_an_error_not_a_crash() -> None:
    region = mmap.mmap(-1, mmap.PAGESIZE)
    gone = np.frombuffer(region, dtype=np.uint8).ctypes.data
    region.close()  # unmapped now: the address is invalid
    dst = np.zeros(64, dtype=np.uint8)
    bad = np.array([[gone, 64]], dtype=np.uint64)
    with pytest.raises(OSError) as info:
        copy_iov(pieces(dst, np.array([0]), np.array([64])), bad)
    assert info.value.errno == errno.EFAULT
