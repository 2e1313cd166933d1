"""The blocking client: :class:`KvxferClient`, the async client's methods on a private loop.

Engines that are not asyncio applications (vLLM's workers and scheduler among them) use it;
each call runs the async client's coroutine on the client's own thread, and the ``start_*``
methods return a future at once so an engine step never waits on the daemon.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from ._client import AsyncKvxferClient, Event
from ._events import OfferReleased
from ._layout import Layout
from ._results import CancelResult, Pool, PullResult, PushResult
from ._ticket import Ticket

__all__ = ["KvxferClient"]

T = TypeVar("T")


class KvxferClient:
    """Blocking client with the same methods as :class:`AsyncKvxferClient`.

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

    def _run(self, coro: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
        async def wrap() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrap(), self._loop).result()

    def reconnect(self) -> KvxferClient:
        self._run(self._async.reconnect())
        return self

    def register_pool(self, buffers: Sequence[Any], layout: Layout, *, name: str = "") -> Pool:
        return self._run(self._async.register_pool(buffers, layout, name=name))

    def deregister_pool(self, pool: Pool | str) -> int:
        return self._run(self._async.deregister_pool(pool))

    def offer(
        self,
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        lease_s: float = 0.0,
        ticket: Ticket | None = None,
        offer_key: bytes = b"",
        readers: int | None = None,
        layers: int = 0,
    ) -> Ticket:
        return self.start_offer(
            pool, block_ids, lease_s=lease_s, ticket=ticket, offer_key=offer_key, readers=readers, layers=layers
        ).result()

    def start_offer(
        self,
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        lease_s: float = 0.0,
        ticket: Ticket | None = None,
        offer_key: bytes = b"",
        readers: int | None = None,
        layers: int = 0,
    ) -> concurrent.futures.Future[Ticket]:
        """Like :meth:`offer` but returns at once (an engine step must not wait on the daemon)."""
        coro = self._async.offer(
            pool, block_ids, lease_s=lease_s, ticket=ticket, offer_key=offer_key, readers=readers, layers=layers
        )
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def new_ticket(self, pool: Pool, num_blocks: int, readers: int = 1) -> Ticket:
        return self._async.new_ticket(pool, num_blocks, readers)

    def pull(
        self,
        ticket: Ticket | str | dict[str, Any],
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        transfer_id: str = "",
        timeout_s: float = 60.0,
        offer_block_indices: Sequence[int] | np.ndarray[Any, Any] | None = None,
    ) -> PullResult:
        future = self.start_pull(
            ticket,
            pool,
            block_ids,
            transfer_id=transfer_id,
            timeout_s=timeout_s,
            offer_block_indices=offer_block_indices,
        )
        return future.result()

    def start_pull(
        self,
        ticket: Ticket | str | dict[str, Any],
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        transfer_id: str = "",
        timeout_s: float = 60.0,
        offer_block_indices: Sequence[int] | np.ndarray[Any, Any] | None = None,
    ) -> concurrent.futures.Future[PullResult]:
        """Like :meth:`pull` but returns at once; the future completes when the bytes landed
        (or holds the :class:`KvxferError` that ended the pull)."""
        coro = self._async.pull(
            ticket,
            pool,
            block_ids,
            transfer_id=transfer_id,
            timeout_s=timeout_s,
            offer_block_indices=offer_block_indices,
        )
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def push(
        self,
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        transfer_id: str,
        to_peer_address: str,
        *,
        lease_s: float = 0.0,
        offer_key: bytes = b"",
        layers: int = 0,
    ) -> PushResult:
        """See :meth:`AsyncKvxferClient.push`."""
        coro = self._async.push(
            pool, block_ids, transfer_id, to_peer_address, lease_s=lease_s, offer_key=offer_key, layers=layers
        )
        return self._run(coro)

    def start_push(
        self,
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        transfer_id: str,
        to_peer_address: str,
        *,
        lease_s: float = 0.0,
        offer_key: bytes = b"",
        layers: int = 0,
    ) -> concurrent.futures.Future[PushResult]:
        """:meth:`push`, returning at once with a future of its answer (an engine step must
        not wait on the daemon)."""
        coro = self._async.push(
            pool, block_ids, transfer_id, to_peer_address, lease_s=lease_s, offer_key=offer_key, layers=layers
        )
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def layers_ready(
        self, offers: Sequence[Ticket | str] | Ticket | str, layers: int, *, offer_key: bytes = b""
    ) -> None:
        """See :meth:`AsyncKvxferClient.layers_ready`."""
        self._run(self._async.layers_ready(offers, layers, offer_key=offer_key))

    def start_layers_ready(
        self, offers: Sequence[Ticket | str] | Ticket | str, layers: int, *, offer_key: bytes = b""
    ) -> concurrent.futures.Future[None]:
        """:meth:`layers_ready`, returning at once (from inside a forward pass, layer by
        layer); the future holds the daemon's refusal, if any."""
        coro = self._async.layers_ready(offers, layers, offer_key=offer_key)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def wait_layers(self, transfer_id: str, layers: int, timeout_s: float | None = None) -> int:
        """See :meth:`AsyncKvxferClient.wait_layers`."""
        return self._run(self._async.wait_layers(transfer_id, layers, timeout_s))

    def start_receive(
        self,
        transfer_id: str,
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        timeout_s: float = 60.0,
        from_daemon_id: str = "",
        offer_block_indices: Sequence[int] | np.ndarray[Any, Any] | None = None,
    ) -> concurrent.futures.Future[PullResult]:
        """:meth:`AsyncKvxferClient.receive`, returning at once; the future completes when the
        pushed bytes landed (or holds the error that ended the wait or the move)."""
        coro = self._async.receive(
            transfer_id,
            pool,
            block_ids,
            timeout_s=timeout_s,
            from_daemon_id=from_daemon_id,
            offer_block_indices=offer_block_indices,
        )
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def watch_release(self, offer_id: str, timeout_s: float | None = None) -> concurrent.futures.Future[OfferReleased]:
        """Like :meth:`wait_released` but returns at once with a future."""
        return asyncio.run_coroutine_threadsafe(self._async.wait_released(offer_id, timeout_s), self._loop)

    def release(self, offer_id: str) -> None:
        self._run(self._async.release(offer_id))

    def start_release(self, offer_id: str) -> concurrent.futures.Future[None]:
        """:meth:`release`, returning at once with a future."""
        return asyncio.run_coroutine_threadsafe(self._async.release(offer_id), self._loop)

    def tier_store(
        self, pool: Pool | str, block_ids: Sequence[int], keys: Sequence[bytes], *, salt: bytes = b""
    ) -> tuple[int, int]:
        return self._run(self._async.tier_store(pool, block_ids, keys, salt=salt))

    def tier_offer(
        self,
        pool: Pool | str,
        keys: Sequence[bytes],
        *,
        salt: bytes = b"",
        lease_s: float = 0.0,
        readers: int = 1,
        prefix: bool = False,
        offer_key: bytes = b"",
    ) -> Ticket | None:
        return self._run(
            self._async.tier_offer(
                pool, keys, salt=salt, lease_s=lease_s, readers=readers, prefix=prefix, offer_key=offer_key
            )
        )

    def start_tier_offer(
        self,
        pool: Pool | str,
        keys: Sequence[bytes],
        *,
        salt: bytes = b"",
        lease_s: float = 0.0,
        readers: int = 1,
        prefix: bool = False,
        offer_key: bytes = b"",
    ) -> concurrent.futures.Future[Ticket | None]:
        """:meth:`tier_offer`, returning at once with a future of its answer."""
        call = self._async.tier_offer(
            pool, keys, salt=salt, lease_s=lease_s, readers=readers, prefix=prefix, offer_key=offer_key
        )
        return asyncio.run_coroutine_threadsafe(call, self._loop)

    def tier_lookup(
        self, pool: Pool | str, keys: Sequence[bytes], *, salt: bytes = b"", from_peer: str = "", offer_key: bytes = b""
    ) -> int:
        return self._run(self._async.tier_lookup(pool, keys, salt=salt, from_peer=from_peer, offer_key=offer_key))

    def start_tier_lookup(
        self, pool: Pool | str, keys: Sequence[bytes], *, salt: bytes = b"", offer_key: bytes = b""
    ) -> concurrent.futures.Future[int]:
        """:meth:`tier_lookup`, returning at once with a future of its answer."""
        call = self._async.tier_lookup(pool, keys, salt=salt, offer_key=offer_key)
        return asyncio.run_coroutine_threadsafe(call, self._loop)

    def start_tier_store(
        self, pool: Pool | str, block_ids: Sequence[int], keys: Sequence[bytes], *, salt: bytes = b""
    ) -> concurrent.futures.Future[tuple[int, int]]:
        """:meth:`tier_store`, returning at once with a future of its answer."""
        return asyncio.run_coroutine_threadsafe(self._async.tier_store(pool, block_ids, keys, salt=salt), self._loop)

    def start_tier_load(
        self, pool: Pool | str, block_ids: Sequence[int], keys: Sequence[bytes], *, salt: bytes = b""
    ) -> concurrent.futures.Future[int]:
        """:meth:`tier_load`, returning at once with a future of its answer."""
        return asyncio.run_coroutine_threadsafe(self._async.tier_load(pool, block_ids, keys, salt=salt), self._loop)

    def tier_load(
        self,
        pool: Pool | str,
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        *,
        salt: bytes = b"",
        from_peer: str = "",
        timeout_s: float = 0.0,
    ) -> int:
        return self._run(
            self._async.tier_load(pool, block_ids, keys, salt=salt, from_peer=from_peer, timeout_s=timeout_s)
        )

    def start_cancel(self, transfer_id: str) -> concurrent.futures.Future[CancelResult]:
        """:meth:`cancel`, returning at once with a future of its answer."""
        return asyncio.run_coroutine_threadsafe(self._async.cancel(transfer_id), self._loop)

    def cancel(self, transfer_id: str) -> CancelResult:
        return self._run(self._async.cancel(transfer_id))

    def extend_lease(self, ticket: Ticket | str | dict[str, Any], lease_s: float) -> float:
        return self._run(self._async.extend_lease(ticket, lease_s))

    def next_event(self, timeout_s: float | None = None) -> Event:
        return self._run(self._async.next_event(timeout_s))

    def wait_released(self, offer_id: str, timeout_s: float | None = None) -> OfferReleased:
        return self._run(self._async.wait_released(offer_id, timeout_s))

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
    await asyncio.get_running_loop().shutdown_asyncgens()
