"""The UCX data plane (UCXX): endpoints from worker addresses, pipelined chunk streams.

Bytes of a remote transfer move as the chunks of a :class:`~kvxferd.dataplane.plan.SidePlan`,
each a tagged UCX message (tag = the transfer's tag base | chunk index), up to ``window`` in
flight. Host pools: a chunk is sent from and received into the pool itself, as one buffer
when contiguous there, else as an IOV list of its segments (:mod:`.ucp_iov`), so UCX gathers
and scatters with no staging. With IOV off (or UCXX progressing on its own thread), the
sender packs fragmented chunks into staging while earlier ones fly and the receiver unpacks
each as it lands. GPU pools always stage: gather and scatter kernels around each chunk.

UCX itself is set up in :mod:`.ucx_setup` (defaults, progress, transport names).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import UnavailableError

from .._log import log_event
from .gpucopy import GpuCopier, UploadedSide, settle
from .hostmem import HostMemory
from .pipeline import ChunkFlow, run_pipeline
from .plan import ChunkPlan
from .sends import TrackedSends
from .ucp_iov import UcpTagIov, contiguous_iov, iov_supported
from .ucx_address import AddressProbe
from .ucx_setup import ProgressDriver, apply_ucx_defaults, take_over_progress

__all__ = ["TagStream", "UcxTransport"]

U8 = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class TagStream:
    """One transfer's chunks over one endpoint: chunk ``c`` is the message tagged
    ``tag_base | c``, moved as ``flow`` says (plan, staging lease, window)."""

    ep: Any
    tag_base: int
    flow: ChunkFlow


class UcxTransport:
    """One UCX worker for the daemon, and an endpoint per peer daemon."""

    def __init__(self, iov_receive: bool = True, iov_send: bool = True) -> None:
        apply_ucx_defaults()
        import ucxx

        self._ucxx = ucxx
        from ucxx._lib.libucxx import UCXAddress

        self._address_cls = UCXAddress
        self.worker_address: bytes = bytes(ucxx.get_worker_address())
        self.progress: ProgressDriver | None = None
        if os.environ.get("UCXPY_PROGRESS_MODE") == "blocking":
            self.progress = ProgressDriver(take_over_progress(ucxx))
        self.transports: list[str] = sorted(ucxx.get_active_transports())
        self._endpoints: dict[str, Any] = {}
        #: Posts every receive itself, so each one can be cancelled on its own; None when
        #: UCXX progresses on another thread (then receives go through UCXX's endpoint).
        self.iov: UcpTagIov | None = UcpTagIov(int(ucxx.get_ucp_worker()), self._busy) if iov_supported() else None
        #: Receive fragmented chunks straight into their segments (else: staging + unpack).
        self.scatter_receive = iov_receive and self.iov is not None
        #: Send fragmented chunks straight from their segments (else: pack into staging).
        self.gather_send = iov_send and self.iov is not None
        self._connecting: dict[str, asyncio.Lock] = {}
        self._retired: list[Any] = []  # see retire()
        self._broken: list[Any] = []  # see break_endpoint()
        #: Unpacks each new peer worker address in a child process before our UCX sees it.
        #: Started now, in the background (its UCX import takes about a second of CPU): a
        #: peer's first transfer must not wait for it under a step deadline.
        self.address_probe = AddressProbe()
        self.address_probe.start()
        self._drains: set[asyncio.Task[None]] = set()
        #: Sends UCX has not finished, including those of cancelled transfers.
        self.sends = TrackedSends(self._busy)

    async def endpoint(self, peer_id: str, address: bytes, error_handling: bool) -> Any:
        """The endpoint to ``peer_id`` (created from its worker address once, then cached).
        The caller has passed ``address`` through :meth:`check_address` first."""
        lock = self._connecting.setdefault(peer_id, asyncio.Lock())
        async with lock:
            ep = self._endpoints.get(peer_id)
            if ep is not None and not ep.closed:
                return ep
            addr = self._address_cls.create_from_buffer(address)
            try:
                with self._busy():  # wire-up messages go both ways: progress them promptly
                    ep = await self._ucxx.create_endpoint_from_worker_address(
                        addr, endpoint_error_handling=error_handling
                    )
            except self._ucxx.exceptions.UCXError as exc:  # e.g. a dead peer's shared memory is gone
                raise UnavailableError(f"cannot make a UCX endpoint to {peer_id}: {exc!r}") from None
            self._endpoints[peer_id] = ep
            return ep

    async def check_address(self, address: bytes, error_handling: bool, peer_id: str) -> None:
        """Unpack a peer's worker address in the probe child first (restarted if it died):
        an address our UCX would abort on fails there, as UnavailableError/IncompatibleError."""
        self.address_probe.start()
        await self.address_probe.check(address, error_handling, peer_id)

    async def close(self) -> None:
        """Stop the probe child (endpoints are left to the process's exit: see retire())."""
        await self.address_probe.close()

    @property
    def receives_cancel_alone(self) -> bool:
        """Whether a receive can be cancelled on its own; else only by dropping its endpoint."""
        return self.iov is not None

    def open_endpoint(self, peer_id: str) -> Any | None:
        """The cached endpoint to ``peer_id`` if it is open, else None (no waiting)."""
        ep = self._endpoints.get(peer_id)
        return ep if ep is not None and not ep.closed else None

    @property
    def receives_unconfirmed(self) -> int:
        """Cancelled receives UCX has not confirmed: their memory may still be written."""
        return self.iov.unconfirmed if self.iov is not None else 0

    @property
    def healthy(self) -> bool:
        return self.progress is None or self.progress.alive

    @property
    def endpoint_count(self) -> int:
        return sum(1 for ep in self._endpoints.values() if not ep.closed)

    def abort_endpoint(self, peer_id: str) -> None:
        """Drop the endpoint to a peer, cancelling whatever is still posted on it."""
        ep = self._endpoints.pop(peer_id, None)
        if ep is not None:
            try:
                ep.abort()
            except Exception:  # noqa: BLE001 - an endpoint already torn down is fine
                pass

    def retire(self, peer_id: str, why: str) -> None:
        """Stop using the endpoint to ``peer_id`` without closing it: the next transfer makes a
        new one. Closing is what must not happen here: UCXX closes by progressing the worker
        until the close completes, on this thread, and towards a dead peer's worker that never
        happens (a survivor stopped answering for as long). Retired endpoints are kept, not
        freed, for the same reason (freeing one closes it); there is one per peer failure."""
        ep = self._endpoints.pop(peer_id, None)
        if ep is not None:
            self._retired.append(ep)
            log_event("ucx.endpoint_retired", logging.WARNING, peer=peer_id, detail=why)

    def break_endpoint(self, ep: Any) -> None:
        """Fault injection only (point ``endpoint_broken``): every later send over ``ep`` fails."""
        self._broken.append(ep)

    @contextlib.contextmanager
    def _retired_on_failure(self, ep: Any) -> Iterator[None]:
        """A send that failed on the data plane retires its endpoint: the next transfer to that
        peer makes a new one instead of reusing one that may keep failing (a peer that froze
        for a while left one that failed every send after it)."""
        try:
            if any(ep is broken for broken in self._broken):
                raise UnavailableError("UCX send failed: the endpoint was broken by fault injection")
            yield
        except UnavailableError:
            for peer_id, cached in list(self._endpoints.items()):
                if cached is ep:
                    self.retire(peer_id, "a send failed on it")
            raise

    async def send(
        self, stream: TagStream, memory: HostMemory, after_chunk: Callable[[int], Awaitable[None]] | None = None
    ) -> None:
        """Send every chunk of the stream's plan: straight from memory mapped here (contiguous chunks,
        and fragmented ones as IOV sends when ``gather_send``), else packed into staging while
        earlier chunks fly (always, for an engine's process memory). ``after_chunk(index)`` is
        awaited once each chunk is sent (the daemon's fault-injection point)."""
        ep, tag_base = stream.ep, stream.tag_base
        mapped = memory.pid is None
        gathers = self.gather_send and mapped  # fragmented chunks sent from their segments
        keep = memory.keep()

        async def pack(chunk: ChunkPlan, staged: U8) -> None:
            # Packed on the event-loop thread: a 2 MiB chunk packs in about 0.3 ms, while a hop
            # to a copy thread and back cost more than the copy on a busy host (b16 remote:
            # 2.1 GB/s through the executor, 3.1 GB/s inline, measured here).
            memory.gather(chunk, memory.stage(chunk, staged))

        async def move(chunk: ChunkPlan, staged: U8 | None) -> None:
            tag = tag_base | chunk.index
            data = memory.view(chunk) if staged is None else memory.stage(chunk, staged)
            if self.iov is None:  # UCXX progresses on its own thread: its endpoint sends
                assert data is not None
                await self.sends.run(ep.send(data, tag=tag, force_tag=True))
            else:
                if ep.closed:
                    raise UnavailableError("the UCX endpoint to the receiver is closed")
                # Posted here: UCX sends a small chunk in place, with no task or wait for it.
                if data is None:  # fragmented in the pool: gathered by UCX
                    sending = self.iov.post_send(ep.ucp_endpoint, memory.iov(chunk), tag, keep)
                else:
                    sending = self.iov.post_send_contig(ep.ucp_endpoint, data, tag, keep)
                if sending is not None:
                    await self.sends.run(sending)
            if after_chunk is not None:
                await after_chunk(chunk.index)

        # No tight progress around the whole: a send UCX holds on to is progressed while it
        # waits (``sends``), and one sent in place needs none.
        with self._retired_on_failure(ep):
            await run_pipeline(stream.flow, move, pack, stage=not gathers, zero_copy=mapped)

    async def receive(
        self,
        stream: TagStream,
        memory: HostMemory,
        executor: Executor,
        on_unconfirmed: Callable[[], None] | None = None,
        on_chunk: Callable[[int], None] | None = None,
    ) -> None:
        """Receive every chunk of the stream's plan into host memory, its window of receives
        posted ahead;
        ``on_chunk(index)`` hears of each chunk once it is in place.

        Into memory mapped here, a contiguous chunk lands in place and, with scatter receives,
        a fragmented one directly in its segments; otherwise (and always for an engine's
        process memory) a chunk lands in staging and is unpacked. ``on_unconfirmed`` is called
        when a cancelled receive is not confirmed by UCX (its memory may still be written).
        """
        loop = asyncio.get_running_loop()
        ep, tag_base, iov = stream.ep, stream.tag_base, self.iov
        mapped = memory.pid is None
        landed: set[int] = set()
        keep = memory.keep()  # the pool's views outlive a deregistration while UCX may write

        async def recv(buf: U8, tag: int) -> None:
            if iov is not None:
                await iov.recv(contiguous_iov(buf), tag, keep=buf, on_unconfirmed=on_unconfirmed)
            else:
                await ep.recv(buf, tag=tag, force_tag=True)

        async def move(chunk: ChunkPlan, staged: U8 | None) -> None:
            tag = tag_base | chunk.index
            in_place = memory.view(chunk)
            if in_place is not None:
                await recv(in_place, tag)
            elif staged is None:
                assert iov is not None
                await iov.recv(memory.iov(chunk), tag, keep=keep, on_unconfirmed=on_unconfirmed)
            else:
                view = memory.stage(chunk, staged)
                await recv(view, tag)
                landed.add(chunk.index)
                await loop.run_in_executor(executor, memory.scatter, chunk, view)
            landed.add(chunk.index)
            if on_chunk is not None:
                on_chunk(chunk.index)

        # Tight progress only while a receive waits on UCX (``iov``), none for one that
        # completed as it was posted (its message was here already).
        with self._busy() if iov is None else nullcontext():
            try:
                stage = not (self.scatter_receive and mapped)
                await run_pipeline(stream.flow, move, stage=stage, zero_copy=mapped)
            except BaseException:
                self._drain_after_failure(stream, landed)
                raise

    async def send_gpu(
        self, stream: TagStream, side: UploadedSide, copier: GpuCopier, mark: Callable[[str], None] | None = None
    ) -> None:
        """Send a GPU pool's chunks: a gather kernel packs each chunk into GPU staging while
        earlier chunks fly. Every chunk is staged: the pool is IPC-imported memory, which UCX's
        cuda_ipc transport cannot export again, while staging is the daemon's own cudaMalloc."""
        ep, tag_base, chunk_bytes = stream.ep, stream.tag_base, stream.flow.plan.chunk_bytes

        async def pack(chunk: ChunkPlan, staged: Any) -> None:
            c = chunk.index
            await settle(copier.launch_stream(side, c, chunk_bytes, staged.data.ptr, to_staging=True))
            if mark is not None and c == 0:
                mark("packed0")

        async def move(chunk: ChunkPlan, staged: Any) -> None:
            await self.sends.run(ep.send(staged[: chunk.nbytes], tag=tag_base | chunk.index, force_tag=True))
            if mark is not None and chunk.index == 0:
                mark("sent0")

        with self._busy(), self._retired_on_failure(ep):
            await run_pipeline(stream.flow, move, pack, zero_copy=False)

    async def receive_gpu(
        self, stream: TagStream, side: UploadedSide, copier: GpuCopier, mark: Callable[[str], None] | None = None
    ) -> None:
        """Receive chunks into GPU staging and scatter each into the pool as it lands. UCX only
        ever writes staging; a scatter that started always finishes before this returns."""
        ep, tag_base, chunk_bytes = stream.ep, stream.tag_base, stream.flow.plan.chunk_bytes
        iov = self.iov
        landed: set[int] = set()

        async def move(chunk: ChunkPlan, staged: Any) -> None:
            c = chunk.index
            tag = tag_base | c
            if iov is not None:
                await iov.recv_contig(staged.data.ptr, chunk.nbytes, tag, keep=staged)
            else:
                await ep.recv(staged[: chunk.nbytes], tag=tag, force_tag=True)
            landed.add(c)
            if mark is not None and c == 0:
                mark("landed0")
            await settle(copier.launch_stream(side, c, chunk_bytes, staged.data.ptr, to_staging=False))
            if mark is not None and c == 0:
                mark("scattered0")

        with self._busy():
            try:
                await run_pipeline(stream.flow, move, zero_copy=False)
            except BaseException:
                self._drain_after_failure(stream, landed)
                raise

    def _drain_after_failure(self, stream: TagStream, landed: set[int]) -> None:
        if self.iov is None:
            return
        plan, tag_base = stream.flow.plan, stream.tag_base
        # The pool's own receives are cancelled by now; swallowing what the sender still has
        # in flight happens in the background, off the failure path.
        missing = [tag_base | c.index for c in plan.chunks if c.index not in landed]
        drain = asyncio.create_task(self._draining(missing, max(c.nbytes for c in plan.chunks)))
        self._drains.add(drain)
        drain.add_done_callback(self._drains.discard)

    async def _draining(self, tags: list[int], nbytes: int) -> None:
        assert self.iov is not None
        with self._busy():  # the sender's chunks still in flight land at transfer speed
            await self.iov.drain(tags, nbytes)

    def _busy(self) -> AbstractContextManager[None]:
        return self.progress.busy() if self.progress is not None else nullcontext()
