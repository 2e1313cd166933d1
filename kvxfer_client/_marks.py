"""Layer marks coalesced per set of offers: at most one ``LayersReady`` call on its way for
the same offers, carrying the latest count.

An engine says after every layer how far it got; when its layers take less time than a call
to the daemon (short prompts, a busy host), the calls would queue up behind each other and the
last one, which lets the transfer finish, would wait behind them all. Only the latest count
matters (the daemon keeps the highest), so while a call is on its way later marks merge into
the next one. Each ``say`` returns once the daemon has a count at least as high as its own.

>>> async def demo() -> list[int]:
...     sent: list[int] = []
...     async def call(key: object, layers: int) -> None:
...         await asyncio.sleep(0.01)
...         sent.append(layers)
...     marks = LayerMarks(call)
...     await marks.say(("off-1",), 1)
...     # Four more layers said before the next call leaves: that one call carries them all.
...     await asyncio.gather(*(marks.say(("off-1",), n) for n in range(2, 6)))
...     return sent
>>> asyncio.run(demo())
[1, 5]
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable

__all__ = ["LayerMarks"]

#: Sends one count for the offers a key names.
Call = Callable[[Hashable, int], Awaitable[None]]


class _Pending:
    def __init__(self) -> None:
        self.want = 0
        self.acked = 0
        self.changed = asyncio.Event()
        self.error: BaseException | None = None


class LayerMarks:
    def __init__(self, call: Call) -> None:
        self._call = call
        self._pending: dict[Hashable, _Pending] = {}

    async def say(self, key: Hashable, layers: int) -> None:
        """Tell the daemon that ``layers`` layers of the offers ``key`` names are written;
        returns once it knows (or raises what the call that carried it raised)."""
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending()
            pending.want = layers
            asyncio.get_running_loop().create_task(self._send(key, pending))
        else:
            pending.want = max(pending.want, layers)
        while pending.acked < layers and pending.error is None:
            changed = pending.changed
            await changed.wait()
        if pending.error is not None and pending.acked < layers:
            raise pending.error

    async def _send(self, key: Hashable, pending: _Pending) -> None:
        try:
            while pending.acked < pending.want:
                count = pending.want
                await self._call(key, count)
                pending.acked = count
                self._notify(pending)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            pending.error = exc
            self._notify(pending)
        finally:
            if self._pending.get(key) is pending:
                del self._pending[key]

    @staticmethod
    def _notify(pending: _Pending) -> None:
        changed, pending.changed = pending.changed, asyncio.Event()
        changed.set()
