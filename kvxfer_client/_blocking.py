"""The blocking client: :class:`KvxferClient`, the async client's methods on a private loop.

Engines that are not asyncio applications (vLLM's workers and scheduler among them) use it.
Every method is made from the async client's own (its signature and docstring are written
once, there): ``client.pull(...)`` runs :meth:`AsyncKvxferClient.pull` on the client's
thread and returns its result; ``client.start_pull(...)`` returns a
:class:`concurrent.futures.Future` at once, so an engine step never waits on the daemon.

>>> KvxferClient.start_pull.__doc__.splitlines()[0]
':meth:`AsyncKvxferClient.pull`, returning at once with a future of its result.'
>>> import inspect; "offer_block_indices" in inspect.signature(KvxferClient.start_pull).parameters
True
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from kvxfer.ticket import Ticket

from ._client import AsyncKvxferClient
from ._results import Pool

__all__ = ["KvxferClient"]

P = ParamSpec("P")
T = TypeVar("T")
AsyncMethod = Callable[Concatenate[AsyncKvxferClient, P], Coroutine[Any, Any, T]]


class _Blocking(Generic[P, T]):
    """A method of :class:`KvxferClient` made from an async one: it waits for the result."""

    def __init__(self, method: AsyncMethod[P, T]) -> None:
        self._method = method
        # What inspect, help() and the docs read: the async method's name, signature and text.
        self.__name__, self.__doc__, self.__wrapped__ = method.__name__, method.__doc__, method

    def __get__(self, client: KvxferClient | None, owner: type) -> Callable[P, T]:
        if client is None:
            return self  # type: ignore[return-value]  # the class attribute, for docs and inspect
        method, loop = self._method, client._loop

        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return asyncio.run_coroutine_threadsafe(method(client._async, *args, **kwargs), loop).result()

        return call

    def __call__(self, client: KvxferClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.__get__(client, KvxferClient)(*args, **kwargs)  # called on the class


class _Starting(Generic[P, T]):
    """A ``start_*`` method made from an async one: it returns a future at once."""

    def __init__(self, method: AsyncMethod[P, T]) -> None:
        self._method = method
        self.__name__, self.__wrapped__ = f"start_{method.__name__}", method
        self.__doc__ = f":meth:`AsyncKvxferClient.{method.__name__}`, returning at once with a future of its result."

    def __get__(self, client: KvxferClient | None, owner: type) -> Callable[P, concurrent.futures.Future[T]]:
        if client is None:
            return self  # type: ignore[return-value]
        method, loop = self._method, client._loop

        def start(*args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[T]:
            return asyncio.run_coroutine_threadsafe(method(client._async, *args, **kwargs), loop)

        return start

    def __call__(self, client: KvxferClient, *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[T]:
        return self.__get__(client, KvxferClient)(*args, **kwargs)


A = AsyncKvxferClient


class KvxferClient:
    """Blocking client with the same methods as :class:`AsyncKvxferClient`, plus a
    ``start_*`` twin of each call an engine step makes (it returns a future at once).

    It runs an asyncio loop on a private thread, so it is safe to use from engines that are
    not asyncio applications.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        engine_name: str = "",
        timeout_s: float = 30.0,
        call_stream: bool | None = None,
        auto_reconnect: bool = False,
        logger: logging.Logger | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvxfer-client", daemon=True)
        self._thread.start()
        self._async = AsyncKvxferClient(
            socket_path,
            engine_name=engine_name,
            timeout_s=timeout_s,
            call_stream=call_stream,
            auto_reconnect=auto_reconnect,
            logger=logger,
        )
        try:
            self._run(self._async.connect())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def session_id(self) -> str:
        return self._async.session_id

    @property
    def daemon_id(self) -> str:
        return self._async.daemon_id

    @property
    def peer_address(self) -> str:
        return self._async.peer_address

    @property
    def socket_path(self) -> str:
        return self._async.socket_path

    @property
    def connected(self) -> bool:
        """True while a session with the daemon is up (see :class:`AsyncKvxferClient`)."""
        return self._async.connected

    @property
    def reconnects(self) -> int:
        return self._async.reconnects

    @property
    def lost_at(self) -> float:
        """``time.monotonic()`` when a session was last lost (0: never)."""
        return self._async.lost_at

    @property
    def restored_at(self) -> float:
        """``time.monotonic()`` when this client's pools were last registered again (0: never)."""
        return self._async.restored_at

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def reconnect(self) -> KvxferClient:
        """See :meth:`AsyncKvxferClient.reconnect`."""
        self._run(self._async.reconnect())
        return self

    def new_ticket(self, pool: Pool, num_blocks: int, readers: int = 1) -> Ticket:
        """See :meth:`AsyncKvxferClient.new_ticket`."""
        return self._async.new_ticket(pool, num_blocks, readers)

    register_pool = _Blocking(A.register_pool)
    deregister_pool = _Blocking(A.deregister_pool)
    offer = _Blocking(A.offer)
    start_offer = _Starting(A.offer)
    pull = _Blocking(A.pull)
    start_pull = _Starting(A.pull)
    push = _Blocking(A.push)
    start_push = _Starting(A.push)
    layers_ready = _Blocking(A.layers_ready)
    start_layers_ready = _Starting(A.layers_ready)
    wait_layers = _Blocking(A.wait_layers)
    receive = _Blocking(A.receive)
    start_receive = _Starting(A.receive)
    release = _Blocking(A.release)
    start_release = _Starting(A.release)
    cancel = _Blocking(A.cancel)
    start_cancel = _Starting(A.cancel)
    extend_lease = _Blocking(A.extend_lease)
    start_extend_lease = _Starting(A.extend_lease)
    next_event = _Blocking(A.next_event)
    wait_released = _Blocking(A.wait_released)
    watch_release = _Starting(A.wait_released)
    tier_store = _Blocking(A.tier_store)
    start_tier_store = _Starting(A.tier_store)
    tier_offer = _Blocking(A.tier_offer)
    start_tier_offer = _Starting(A.tier_offer)
    tier_lookup = _Blocking(A.tier_lookup)
    tier_load = _Blocking(A.tier_load)

    def _stop_loop(self) -> None:
        # gRPC leaves tasks of its own on the loop (a call's status handler); end them here,
        # as asyncio.run does, or they are reported destroyed while pending at exit.
        self._run(_finish_tasks())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._async.close())
        self._stop_loop()

    def __enter__(self) -> KvxferClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _finish_tasks() -> None:
    """Cancel and await every other task of the running loop, then its async generators."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
