"""Pools: the engine's KV memory registered with the daemon, and registered again from the
same memory after a new session (same pool ids and offer keys)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvxfer.errors import InvalidRequestError
from kvxfer.host_memory import HostBuffer
from kvxfer.layout import Layout
from kvxfer.proto import common_pb2, engine_pb2

from ._buffers import buffer_spec
from ._fds import attach_process, pass_fds
from ._host_tensor import allow_daemon
from ._results import Pool
from ._session import SessionClient

__all__ = ["PoolClient"]


class PoolClient(SessionClient):
    """The pool half of the client (see :class:`~._client.AsyncKvxferClient`)."""

    def _setup(self) -> None:
        super()._setup()
        #: Registered pools, registered again by :meth:`reconnect`.
        self._pools: list[Pool] = []
        #: The session this process is attached to (its CPU tensors can be registered).
        self._attached_session = ""

    async def register_pool(self, buffers: Sequence[Any], layout: Layout, *, name: str = "") -> Pool:
        """Register buffers and their layout; the daemon maps them.

        ``buffers`` are all of one kind: :class:`HostBuffer` (POSIX shared memory); CPU tensors
        this process owns (numpy arrays, torch CPU tensors: ``__array_interface__`` or DLPack;
        contiguous and writable; the daemon reaches them through the kernel, see
        ``kvxfer_client._host_tensor``); or GPU tensors of one GPU (``__cuda_array_interface__``
        or DLPack: torch, CuPy, ...; contiguous, allocated with ``cudaMalloc`` so that a legacy
        CUDA IPC handle exists).
        Several buffers per pool are normal (vLLM keeps one tensor per layer). The engine
        keeps tensors alive until the pool is deregistered, and offers blocks only after
        the stream that wrote them has been synchronised.

        Host buffers go to the daemon as open file descriptors (never names), so the daemon
        maps only memory this engine can open; the same buffers may be registered again, e.g.
        after the daemon restarted.
        """
        await self._ready()
        pool = await self._register(buffers, layout, name)
        self._pools.append(pool)
        return pool

    async def _register(self, buffers: Sequence[Any], layout: Layout, name: str, keep: Pool | None = None) -> Pool:
        if not buffers:
            raise InvalidRequestError("a pool needs at least one buffer")
        specs = [buffer_spec(b, advise=keep is None) for b in buffers]
        layout.validate([s.size for s in specs])
        host = [i for i, b in enumerate(buffers) if isinstance(b, HostBuffer)]
        if host:
            fds = [buffers[i].fd for i in host]
            if min(fds) < 0:
                raise InvalidRequestError("host buffers must come from HostBuffer.create (they pass their descriptor)")
            handles = await asyncio.to_thread(pass_fds, self.socket_path + ".fds", self.session_id, fds, self.timeout_s)
            for i, handle in zip(host, handles, strict=True):
                specs[i].fd_handle = handle
        if any(s.kind == common_pb2.MEMORY_KIND_HOST_PROCESS for s in specs):
            await self._attach_process()
        req = engine_pb2.RegisterPoolRequest(
            session_id=self.session_id, buffers=specs, layout=layout.to_proto(), name=name
        )
        if keep is not None:  # registered again: the id and key the engine's other sessions hold
            req.pool_id, req.offer_key = keep.pool_id, keep.offer_key
        resp = await self._call(self._engine.RegisterPool, req)
        return Pool(resp.pool_id, layout, tuple(buffers), resp.fingerprint, name, bytes(resp.offer_key))

    async def _attach_process(self) -> None:
        """Attach this process to the session (once per session) so the daemon may reach the
        memory of its CPU tensors, and let it past Yama where that is on."""
        if self._attached_session == self.session_id:
            return
        path = self.socket_path + ".fds"
        daemon_pid = await asyncio.to_thread(attach_process, path, self.session_id, self.timeout_s)
        allow_daemon(daemon_pid)
        self._attached_session = self.session_id

    async def deregister_pool(self, pool: Pool | str) -> int:
        """Deregister a pool; returns how many of its offers were released."""
        await self._ready()
        pool_id = pool.pool_id if isinstance(pool, Pool) else pool
        self._pools = [p for p in self._pools if p.pool_id != pool_id]
        req = engine_pb2.DeregisterPoolRequest(pool_id=pool_id, session_id=self.session_id)
        resp = await self._call(self._engine.DeregisterPool, req)
        return int(resp.released_offers)

    async def _restore(self) -> None:
        for pool in self._pools:
            fresh = await self._register(list(pool.buffers), pool.layout, pool.name, keep=pool)
            pool.pool_id, pool.fingerprint = fresh.pool_id, fresh.fingerprint

    def _restored(self) -> str:
        ids = ", ".join(p.pool_id for p in self._pools) or "none"
        return f"{len(self._pools)} pool(s) registered again from the same memory ({ids})"
