"""Shared memory an engine cannot shrink under the daemon.

The daemon maps an engine's host buffers (``MAP_SHARED``) and copies, sums and sends from
them on its own threads. If the engine could truncate the file afterwards, the daemon's next
touch of a page past the new end would be ``SIGBUS``: one engine could kill every transfer of
the node. So a buffer is mapped only once its file is sealed against shrinking
(``F_SEAL_SHRINK``: no ``ftruncate`` below the current size, by anyone, for the file's life).
``kvxfer_client.HostBuffer.create`` makes sealed memfds; an unsealed memfd that still allows
sealing is sealed here; anything else (a ``/dev/shm`` file, a memfd sealed against further
seals) is refused with the fix.

>>> import os
>>> fd = os.memfd_create("doc", os.MFD_ALLOW_SEALING)
>>> os.ftruncate(fd, 4096); seal_against_shrinking(fd, "buffer 0")
>>> os.ftruncate(fd, 0)
Traceback (most recent call last):
...
PermissionError: [Errno 1] Operation not permitted
>>> os.close(fd)
"""

from __future__ import annotations

import fcntl

from kvxfer.errors import InvalidRequestError

__all__ = ["seal_against_shrinking"]

_FIX = "create host buffers with kvxfer_client.HostBuffer.create (a memfd sealed against shrinking)"


def seal_against_shrinking(fd: int, what: str) -> None:
    """Make sure the file behind ``fd`` can never shrink (sealing it if it can still be), or
    refuse it (``InvalidRequestError``)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidRequestError(f"{what}: the descriptor cannot be sealed against shrinking; {_FIX}") from None
    if seals & fcntl.F_SEAL_SHRINK:
        return
    if seals & fcntl.F_SEAL_SEAL:
        raise InvalidRequestError(
            f"{what}: the file may shrink under the daemon (not sealed with F_SEAL_SHRINK, and closed to new "
            f"seals: a /dev/shm file or a sealed memfd); {_FIX}"
        )
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except OSError as exc:
        raise InvalidRequestError(f"{what}: cannot seal the file against shrinking ({exc.strerror}); {_FIX}") from None
