"""What the client's calls return: a registered :class:`Pool`, a :class:`PullResult` (also
a Receive's), a :class:`PushResult` and a :class:`CancelResult`; and :class:`PoolRef`, how
another session of the same engine names a pool it may offer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvxfer.layout import Layout
from kvxfer.proto import common_pb2, engine_pb2
from kvxfer.ticket import Ticket

__all__ = ["CancelResult", "Pool", "PoolRef", "PullResult", "PushResult", "pool_target", "pull_result"]


@dataclass
class Pool:
    """A registered pool: its id, layout and the buffers the engine keeps alive.

    :meth:`AsyncKvxferClient.reconnect` registers the pool again with a restarted daemon and
    updates ``pool_id`` in place, so the engine keeps using the same object.
    """

    pool_id: str
    layout: Layout
    #: The :class:`HostBuffer` objects or GPU tensors, kept alive with the pool.
    buffers: tuple[Any, ...]
    fingerprint: str
    name: str = ""
    #: Lets another session of this engine offer the pool's blocks (see :class:`PoolRef`).
    offer_key: bytes = field(default=b"", repr=False)

    def ref(self) -> PoolRef:
        """This pool as another session of the engine names it to offer its blocks."""
        return PoolRef(self.pool_id, self.offer_key)


@dataclass(frozen=True)
class PoolRef:
    """A pool another session of this engine registered, named by its id and the offer key
    the registering session got (``Pool.offer_key``): with it, this session may offer the
    pool's blocks, e.g. a vLLM worker's pool offered from the scheduler process.

    >>> PoolRef("p-1", bytes(32))
    PoolRef(pool_id='p-1')
    """

    pool_id: str
    offer_key: bytes = field(repr=False)


def pool_target(pool: Pool | PoolRef | str) -> tuple[str, bytes]:
    """The pool id and the offer key to send for ``pool`` (no key for this session's own)."""
    if isinstance(pool, PoolRef):
        return pool.pool_id, pool.offer_key
    return (pool.pool_id if isinstance(pool, Pool) else pool), b""


@dataclass(frozen=True)
class PullResult:
    """What a completed pull moved, and how."""

    transfer_id: str
    bytes: int
    path: str
    transport: str
    #: The whole pull in the decode daemon (checks, control plane, data).
    duration_s: float
    #: Only the data movement (first byte moved to last byte landed).
    data_plane_s: float = 0.0
    #: GPU local path: the copy's GPU time (CUDA events); 0.0 where not measured.
    device_s: float = 0.0
    #: How the blocks were remapped between geometries (other TP, head order, block size);
    #: "" when they moved as they are.
    mapping: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes / self.duration_s / 1e9 if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class PushResult:
    """How a push went: its offer's ticket, and the mode the pair ended up in."""

    ticket: Ticket
    #: "push" (the decode daemon took it) or "pull" (hand ``ticket`` over to be pulled).
    mode: str
    mode_reason: str


def pull_result(resp: engine_pb2.PullResponse) -> PullResult:
    return PullResult(
        resp.transfer_id,
        resp.bytes,
        _PATHS.get(resp.path, "?"),
        resp.transport,
        resp.duration_s,
        resp.data_plane_s,
        resp.device_s,
        resp.mapping,
    )


_PATHS = {common_pb2.TRANSFER_PATH_LOCAL: "local", common_pb2.TRANSFER_PATH_REMOTE: "remote"}


@dataclass(frozen=True)
class CancelResult:
    """What :meth:`AsyncKvxferClient.cancel` found and did."""

    cancelled: bool  # a transfer with that id was running and is stopped
    may_still_write: bool  # UCX did not confirm the stop: quarantine the destination blocks
