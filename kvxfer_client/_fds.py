"""Passing open file descriptors to kvxferd (SCM_RIGHTS over ``<engine socket>.fds``).

The daemon answers each message with one handle per descriptor; RegisterPool names them in
``BufferSpec.fd_handle``. Blocking: the async client runs it on a worker thread.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence

from ._errors import InvalidRequestError, UnavailableError

__all__ = ["pass_fds"]

MAX_FDS_PER_MESSAGE = 250


def pass_fds(path: str, session_id: str, fds: Sequence[int], timeout_s: float) -> list[str]:
    """Send ``fds`` to the daemon for ``session_id``; returns their handles in order."""
    handles: list[str] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
                batch = list(fds[start : start + MAX_FDS_PER_MESSAGE])
                socket.send_fds(sock, [json.dumps({"session_id": session_id}).encode()], batch)
                reply = json.loads(sock.recv(1 << 20) or b"{}")
                if "error" in reply:
                    raise InvalidRequestError(f"kvxferd refused the buffers' descriptors: {reply['error']}")
                got = reply.get("handles")
                if not isinstance(got, list) or len(got) != len(batch):
                    raise UnavailableError("kvxferd's fd socket gave no handles")
                handles.extend(str(h) for h in got)
    except (OSError, ValueError) as exc:
        raise UnavailableError(f"cannot pass buffer descriptors to kvxferd at {path}: {exc}") from None
    return handles
