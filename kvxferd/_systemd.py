"""systemd readiness and watchdog notifications (``Type=notify``, ``WatchdogSec=``).

The protocol is one datagram per message to the Unix socket named by ``$NOTIFY_SOCKET``
(a leading ``@`` means the abstract namespace). Watchdog pings come from the event loop itself,
so a wedged loop stops pinging and systemd restarts the daemon. Without ``$NOTIFY_SOCKET``
(not started by systemd) every call is a no-op.

>>> Notifier(environ={}).notify("READY=1")
False
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping

__all__ = ["Notifier"]


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process that must ping; absent means "the main process".
        mine = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, message: str) -> bool:
        """Send one notification; returns whether it was sent."""
        if not self._address:
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.connect(self._address)
                s.sendall(message.encode())
            except OSError:
                return False
        return True

    def start_watchdog(self) -> None:
        """Ping ``WATCHDOG=1`` at half the interval systemd asked for, from this event loop."""
        if self.enabled and self.watchdog_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pings(), name="systemd-watchdog")

    async def _pings(self) -> None:
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 2)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
