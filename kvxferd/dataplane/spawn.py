"""Starting a helper process from a daemon that has UCX loaded and threads running.

``fork()`` runs every ``pthread_atfork`` handler in the child, and the child starts with one
thread and a copy of every lock as it was at that instant. UCX installs memory hooks
(``munmap`` goes through its registration cache, behind a spinlock) and uvloop's after-fork
handler unmaps memory: a child forked while another daemon thread held that spinlock spun
forever before ``exec``, and the daemon's event loop waited for the ``exec`` with it. So helpers
are started with ``posix_spawn`` (glibc: ``clone(CLONE_VM | CLONE_VFORK)``, then ``exec``; no
fork handlers run, nothing of the parent's state is touched in between), and reaped through a
pidfd on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

__all__ = ["SpawnedChild", "spawn_child"]


class SpawnedChild:
    """A spawned child with pipes on its stdin and stdout (stderr goes to /dev/null); the
    parts of ``asyncio.subprocess.Process`` the daemon uses."""

    def __init__(self, pid: int, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self._pidfd = os.pidfd_open(pid)
        self._returncode: int | None = None

    @property
    def returncode(self) -> int | None:
        """The exit code once the child ended (reaped now if it has), else None."""
        if self._returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self._ended(status)
        return self._returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)

    async def wait(self) -> int:
        """Wait until the child ends (its pidfd turns readable), then reap it."""
        loop = asyncio.get_running_loop()
        while self.returncode is None:
            ended: asyncio.Future[None] = loop.create_future()

            def wake(ended: asyncio.Future[None] = ended) -> None:
                if not ended.done():
                    ended.set_result(None)

            loop.add_reader(self._pidfd, wake)
            try:
                await ended
            finally:
                loop.remove_reader(self._pidfd)
        assert self._returncode is not None
        return self._returncode

    def _ended(self, status: int) -> None:
        self._returncode = os.waitstatus_to_exitcode(status)
        self.stdin.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


async def spawn_child(argv: list[str]) -> SpawnedChild:
    """Start ``argv`` with ``posix_spawn`` (see the module docstring), its stdin and stdout
    on pipes to this event loop."""
    loop = asyncio.get_running_loop()
    child_in, to_child = os.pipe2(os.O_CLOEXEC)
    from_child, child_out = os.pipe2(os.O_CLOEXEC)
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        pid = os.posix_spawn(  # noqa: ASYNC221 - returns once the child exec'd (vfork semantics)
            argv[0],
            argv,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, child_in, 0),
                (os.POSIX_SPAWN_DUP2, child_out, 1),
                (os.POSIX_SPAWN_DUP2, devnull, 2),
            ],
        )
    except BaseException:
        for fd in (to_child, from_child):
            os.close(fd)
        raise
    finally:
        for fd in (child_in, child_out, devnull):
            os.close(fd)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_child, "rb", 0))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(to_child, "wb", 0))
    return SpawnedChild(pid, asyncio.StreamWriter(transport, protocol, None, loop), reader)
