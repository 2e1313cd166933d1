"""The fd socket: engines pass the open descriptors of their host memory (SCM_RIGHTS), and
attach their own process for memory registered as it is.

gRPC carries neither file descriptors nor the caller's credentials, so next to the engine
socket the daemon listens on ``<engine socket>.fds`` (SOCK_SEQPACKET, same owner, group and
mode). Each message in is a JSON object naming the engine's session, and gets one JSON reply:

- ``{"session_id": ...}`` with up to :data:`MAX_FDS_PER_MESSAGE` descriptors attached:
  ``{"handles": [...]}``, one per descriptor, in order. A handle names the descriptor in
  ``BufferSpec.fd_handle`` of a RegisterPool of the same session, once; the session's unused
  descriptors are closed when it ends.
- ``{"session_id": ..., "attach": "process"}``, nothing attached: the process that connected
  (the kernel's peer credentials of this connection, never a pid in the message) is attached
  to the session, which may then register its memory as ``MEMORY_KIND_HOST_PROCESS``. Reply
  ``{"attached": {"pid": ..., "daemon_pid": ...}}``.
- Any refusal: ``{"error": ...}``.

Because the engine opened the memory itself, the kernel checked *its* permissions: the daemon
never opens memory by name on an engine's behalf. Everything here is hostile until checked:
a message that is not a JSON object naming a live session gets an error and its descriptors
closed; connections are capped and dropped when idle.
"""

from __future__ import annotations

import array
import asyncio
import grp
import json
import logging
import os
import socket
from collections.abc import Callable

from kvxfer.errors import InvalidRequestError, KvxferError, NotFoundError

from .._log import log_event
from .._sessions import Session
from ..memory.process import attach_peer

__all__ = ["MAX_FDS_PER_MESSAGE", "FdSocket"]

MAX_FDS_PER_MESSAGE = 250  # the kernel's SCM_MAX_FD is 253
MAX_CONNECTIONS = 64
IDLE_S = 10.0
_MESSAGE_BYTES = 4096


class FdSocket:
    def __init__(self, path: str, sessions: Callable[[str], Session | None], group: str = "") -> None:
        self.path = path
        self._sessions = sessions
        self._group = group
        self._sock: socket.socket | None = None
        self._conns: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}

    def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)  # the engine socket beside it was checked to be ours to take
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(self.path)
        os.chmod(self.path, 0o660)
        if self._group:
            gid = int(self._group) if self._group.isdigit() else grp.getgrnam(self._group).gr_gid
            os.chown(self.path, -1, gid)
        sock.listen(MAX_CONNECTIONS)
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in list(self._conns):
            self._drop(fd)
        if self._sock is not None:
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _accept(self) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        if len(self._conns) >= MAX_CONNECTIONS:
            conn.close()
            return
        conn.setblocking(False)
        loop = asyncio.get_running_loop()
        fd = conn.fileno()
        self._conns[fd] = (conn, loop.call_later(IDLE_S, self._drop, fd))
        loop.add_reader(fd, self._receive, fd)

    def _drop(self, fd: int) -> None:
        entry = self._conns.pop(fd, None)
        if entry is not None:
            conn, timer = entry
            timer.cancel()
            asyncio.get_running_loop().remove_reader(fd)
            conn.close()

    def _receive(self, fd: int) -> None:
        conn = self._conns[fd][0]
        fds = array.array("i")
        try:
            msg, ancdata, flags, _ = conn.recvmsg(_MESSAGE_BYTES, socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * fds.itemsize))
        except BlockingIOError:
            return
        except OSError:
            self._drop(fd)
            return
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
        passed = list(fds)
        if not msg and not passed:
            self._drop(fd)  # the engine hung up
            return
        reply: dict[str, object]
        try:
            reply = self._answer(conn, msg, passed, flags)
        except KvxferError as exc:
            for f in passed:
                os.close(f)
            reply = {"error": str(exc)}
            log_event("fds.refused", logging.WARNING, detail=str(exc))
        try:
            conn.send(json.dumps(reply).encode())
        except OSError:
            self._drop(fd)

    def _answer(self, conn: socket.socket, msg: bytes, passed: list[int], flags: int) -> dict[str, object]:
        if flags & socket.MSG_TRUNC:
            raise InvalidRequestError(f"a message is at most {_MESSAGE_BYTES} bytes")
        if flags & socket.MSG_CTRUNC:
            raise InvalidRequestError(f"a message carries at most {MAX_FDS_PER_MESSAGE} descriptors")
        try:
            request = json.loads(msg)
        except ValueError:
            raise InvalidRequestError("the fd socket takes one JSON object per message") from None
        if not isinstance(request, dict) or not isinstance(request.get("session_id"), str):
            raise InvalidRequestError('expected {"session_id": "..."} with the descriptors attached')
        session = self._sessions(request["session_id"])
        if session is None:
            raise NotFoundError("no such session (open one with WatchEvents first)")
        if "attach" in request:
            if request["attach"] != "process" or passed:
                raise InvalidRequestError('expected {"session_id": "...", "attach": "process"} with nothing attached')
            process = attach_peer(conn)
            session.attach(process)
            return {"attached": {"pid": process.pid, "daemon_pid": os.getpid()}}
        if not passed:
            raise InvalidRequestError("no descriptors attached (SCM_RIGHTS)")
        return {"handles": session.deposit_fds(passed)}
