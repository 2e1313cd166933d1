"""The fd socket (``<engine socket>.fds``): what gRPC cannot carry.

:func:`pass_fds` passes open file descriptors (SCM_RIGHTS); the daemon answers with one handle
per descriptor, which RegisterPool names in ``BufferSpec.fd_handle``. :func:`attach_process`
attaches this process to the session, so its own memory can be registered as it is; the
daemon takes who we are from the connection's peer credentials. Blocking: the async client
runs both on a worker thread.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Sequence

from kvxfer.errors import InvalidRequestError, UnavailableError

__all__ = ["attach_process", "pass_fds"]

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


def attach_process(path: str, session_id: str, timeout_s: float) -> int:
    """Attach this process to ``session_id``; returns the daemon's pid (from the kernel's
    record of who listens on the socket, not from the daemon's reply)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            daemon_pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            sock.send(json.dumps({"session_id": session_id, "attach": "process"}).encode())
            reply = json.loads(sock.recv(1 << 16) or b"{}")
    except (OSError, ValueError) as exc:
        raise UnavailableError(f"cannot attach this process to kvxferd at {path}: {exc}") from None
    if "error" in reply:
        raise InvalidRequestError(f"kvxferd refused to attach this process: {reply['error']}")
    if not isinstance(reply.get("attached"), dict):
        raise UnavailableError("kvxferd's fd socket did not confirm the attachment")
    return int(daemon_pid)
