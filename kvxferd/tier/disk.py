"""The tier's disk below host memory: one file per namespace in ``tier_disk_dir``, cut into
slots of the namespace's chunk size, written and read whole, a chunk at a time.

Files are opened with ``O_DIRECT`` where the filesystem takes it (page-aligned slots, host
slots page-aligned too): chunks go to the device without passing through the page cache,
which would otherwise hold a second copy of what the tier evicted to save memory. Each chunk's
checksum (:func:`..dataplane.checksum.bytes_sum`) is taken as it is written and checked as it
is read back: a chunk that was not written whole, or reads back other bytes, is dropped and
counted (``disk_failures``), never served.

The tier on disk does not outlive the daemon: files of an earlier run are removed at start
(a restarted daemon starts clean, as its host memory does).
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import Executor

import numpy as np
import numpy.typing as npt

from .._log import log_event
from ..dataplane.checksum import bytes_sum

__all__ = ["DiskStore"]

SUFFIX = ".kvtier"
U8 = npt.NDArray[np.uint8]


class DiskStore:
    def __init__(self, directory: str, executor: Executor) -> None:
        self.directory = directory
        self.executor = executor
        self.direct = True
        self._files: dict[str, int] = {}
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for name in os.listdir(directory):
            if name.endswith(SUFFIX):
                os.unlink(os.path.join(directory, name))  # an earlier run's: the tier starts clean

    def _fd(self, namespace: str) -> int:
        fd = self._files.get(namespace)
        if fd is None:
            path = os.path.join(self.directory, namespace + SUFFIX)
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
            try:
                fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            except OSError:  # e.g. tmpfs: no O_DIRECT
                fd = os.open(path, flags, 0o600)
                if self.direct:
                    self.direct = False
                    log_event("tier.disk_buffered", logging.INFO, directory=self.directory, detail="no O_DIRECT here")
            self._files[namespace] = fd
        return fd

    def write(self, namespace: str, slot: int, chunk: U8) -> int:
        """Write a chunk (page-aligned, whole pages) to its slot; returns its checksum. Raises
        OSError when it was not written whole. Runs in a copy thread."""
        fd = self._fd(namespace)
        done = os.pwrite(fd, chunk.data, slot * len(chunk))
        if done != len(chunk):
            raise OSError(f"short write: {done} of {len(chunk)} bytes")
        return bytes_sum(chunk)

    def read(self, namespace: str, slot: int, into: U8, expected_sum: int) -> bool:
        """Read a chunk back into ``into``: True when every byte came back as written."""
        fd = self._fd(namespace)
        try:
            done = os.preadv(fd, [into.data], slot * len(into))
        except OSError as exc:
            log_event("tier.disk_read_failed", logging.WARNING, namespace=namespace, slot=slot, error=repr(exc))
            return False
        return done == len(into) and bytes_sum(into) == expected_sum

    def close(self) -> None:
        for namespace, fd in self._files.items():
            with contextlib.suppress(OSError):
                os.close(fd)
                os.unlink(os.path.join(self.directory, namespace + SUFFIX))
        self._files.clear()
