"""Remote pulls that share one wire transfer: several readers behind this daemon pulling the
same bytes of one offer (MLA's latent KV, which every decode rank holds whole; a replicated
KV head; decode ranks of one node reading one prefill rank's blocks).

The first such pull runs as usual and *leads*. A pull that arrives while it runs, with the
same ticket (its token included), the same source blocks and a destination that holds what
the leader's holds (same bytes per block, same heads), *joins* it and moves nothing over the
wire. Once every byte has landed in the leader's destination, and before the leader says done,
the daemon copies the blocks from there into each joiner's destination (a local copy: the
bytes cross the network once), then tells the offerer how many readers the transfer served
(``TransferDone.readers``). The offerer counts them all; the outcome is the leader's.

A joiner never waits on a leader that cannot serve it: when the leader fails before its
copies, or a copy into the joiner fails, the joiner pulls on its own (the offer is still
there unless the failure released it, and then its own pull says so). Joining stops when the
leader starts copying: a later pull reads on its own.

>>> from kvxfer.geometry import KvGeometry
>>> from kvxfer.layout import Layout, ModelInfo
>>> def sig(tp, rank):
...     g = KvGeometry(16, total_kv_heads=1, head_bytes=1152, order="HND")  # MLA: one latent "head"
...     m = ModelInfo("deepseek", "bf16", 16, tp, rank)
...     return Layout.paged_kv(num_layers=2, num_blocks=8, block_bytes=16 * 1152, model=m, geometry=g).signature()
>>> holds_same_blocks(sig(4, 0), sig(4, 3)), holds_same_blocks(sig(4, 0), sig(2, 1))
(True, True)
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.errors import KvxferError, UnavailableError
from kvxfer.geometry import KvGeometry, rank_heads
from kvxfer.proto import common_pb2
from kvxfer.ticket import Ticket

from .._log import log_event
from .._transfers import TransferRecord
from ..memory.pools import Pool

__all__ = ["SharedReads", "holds_same_blocks"]

#: Copies blocks between two pools that hold the same bytes per block (no offer involved).
CopyBlocks = Callable[[Pool, np.ndarray[Any, Any], Pool, np.ndarray[Any, Any]], Awaitable[object]]


def holds_same_blocks(a: common_pb2.LayoutSignature, b: common_pb2.LayoutSignature) -> bool:
    """Whether a pull fills a block of ``a``'s pool with exactly what it would put in ``b``'s
    (then one pool's blocks can be copied into the other's): same bytes per region, model and
    geometry, and the same KV heads (TP rank and size may differ where the heads do not)."""
    return _content_key(a) == _content_key(b)


def _content_key(sig: common_pb2.LayoutSignature) -> bytes:
    content = common_pb2.LayoutSignature()
    content.CopyFrom(sig)
    geometry = KvGeometry.from_proto(sig.geometry)
    if geometry is not None:
        # What a rank holds is its heads: ranks of any TP holding the same heads match.
        heads = rank_heads(geometry.total_kv_heads, max(1, sig.model.tp_size), sig.model.tp_rank)
        content.model.tp_size, content.model.tp_rank = heads.first, heads.count
    return content.SerializeToString(deterministic=True)


@dataclass(eq=False)
class _Joiner:
    record: TransferRecord
    dst: Pool
    dst_ids: np.ndarray[Any, Any]
    deadline: asyncio.Timeout
    #: "waiting" -> "copying" -> "copied" (counted in done) or "fallback" (pulls on its own).
    state: str = "waiting"
    #: Set when the leader no longer touches this joiner's destination.
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    #: The leader's outcome once this joiner is counted: None for success, else the failure.
    outcome: asyncio.Future[BaseException | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class _Group:
    """One leading pull and the pulls that joined it."""

    def __init__(self, leader: TransferRecord, dst: Pool, dst_ids: np.ndarray[Any, Any], room: int) -> None:
        self.leader = leader
        self.dst = dst
        self.dst_ids = dst_ids
        self.room = room  # joiners it may still take: the ticket's other readers
        self.joiners: list[_Joiner] = []
        self.open = True


class SharedReads:
    """The groups of pulls sharing one wire transfer on this daemon, by what they read."""

    def __init__(self, copy_blocks: CopyBlocks) -> None:
        self._copy = copy_blocks
        self._groups: dict[bytes, _Group] = {}

    @staticmethod
    def key(ticket: Ticket, dst: Pool, dst_ids: np.ndarray[Any, Any], indices: np.ndarray[Any, Any] | None) -> bytes:
        """What a pull reads: pulls with equal keys get equal bytes in their destinations."""
        h = hashlib.blake2b(digest_size=20)
        for part in (
            ticket.daemon_id.encode(),
            ticket.offer_id.encode(),
            ticket.token,
            _content_key(dst.layout.signature()),
        ):
            h.update(len(part).to_bytes(4, "little") + part)
        h.update(len(dst_ids).to_bytes(8, "little"))
        if indices is not None:
            h.update(b"|" + np.ascontiguousarray(indices, dtype=np.int64).tobytes())
        return h.digest()

    async def join(
        self, key: bytes, record: TransferRecord, dst: Pool, dst_ids: np.ndarray[Any, Any], deadline: asyncio.Timeout
    ) -> bool:
        """Join the pull reading ``key`` if one is open and has room: True once this pull's
        destination is filled and the leader's transfer committed (raises its failure when
        it failed after counting this reader); False when there is nothing to join or the
        leader could not serve this pull (then the caller pulls on its own). ``deadline``,
        the pull's own, stops applying when the leader starts copying: the leader's bounds
        it from there, as the offerer's bounds a pull that said done."""
        group = self._groups.get(key)
        if group is None or not group.open or group.room == 0:
            return False
        group.room -= 1
        joiner = _Joiner(record, dst, dst_ids, deadline)
        group.joiners.append(joiner)
        record.transport = "shared"
        log_event("pull.joined", transfer_id=record.transfer_id, leader=group.leader.transfer_id)
        try:
            await joiner.settled.wait()
        except asyncio.CancelledError:
            if joiner.state == "waiting":
                joiner.state = "fallback"  # left before the leader reached it
                raise
            # The leader is writing this destination: the engine hears nothing before it is
            # done, and once this reader is counted the cancel is too late (as after done).
            await asyncio.shield(joiner.settled.wait())
            if joiner.state == "fallback":
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        if joiner.state == "fallback":
            return False
        failure = await joiner.outcome
        if failure is not None:
            raise _as_joiners(failure, group.leader.transfer_id)
        record.nbytes = group.leader.nbytes
        record.mapping = group.leader.mapping
        record.detail = (
            f"bytes copied from {group.leader.transfer_id}, which read them once for {len(group.joiners) + 1} readers"
        )
        return True

    def lead(self, key: bytes, record: TransferRecord, dst: Pool, dst_ids: np.ndarray[Any, Any], readers: int) -> _Lead:
        """Open a group that later pulls reading ``key`` can join (``readers``: the ticket's)."""
        group = _Group(record, dst, dst_ids, max(0, readers - 1))
        self._groups.setdefault(key, group)
        return _Lead(self, key, group)

    async def _serve(self, key: bytes, group: _Group) -> int:
        """Close the group and copy the leader's blocks into every joiner still waiting;
        returns how many more readers the transfer served."""
        self._close(key, group)
        served = 0
        for joiner in group.joiners:
            if joiner.state != "waiting":
                continue
            joiner.state = "copying"
            joiner.deadline.reschedule(None)
            try:
                await self._copy(group.dst, group.dst_ids, joiner.dst, joiner.dst_ids)
            except Exception as exc:  # noqa: BLE001 - the joiner pulls on its own instead
                log_event("pull.join_failed", transfer_id=joiner.record.transfer_id, error=repr(exc))
                joiner.state = "fallback"
            else:
                joiner.state = "copied"
                joiner.record.committed = True  # the leader says done next: a cancel is too late
                served += 1
            finally:
                joiner.settled.set()
        if served:
            group.leader.detail = f"read once for {served + 1} readers behind this daemon"
        return served

    def _close(self, key: bytes, group: _Group) -> None:
        group.open = False
        if self._groups.get(key) is group:
            del self._groups[key]

    def _end(self, key: bytes, group: _Group, failure: BaseException | None) -> None:
        """The leader ended: counted joiners learn its outcome, waiting ones pull on their own."""
        self._close(key, group)
        for joiner in group.joiners:
            if joiner.state == "copied":
                joiner.outcome.set_result(failure)
            elif joiner.state == "waiting":
                joiner.state = "fallback"
                joiner.settled.set()


def _as_joiners(failure: BaseException, leader: str) -> KvxferError:
    """The leader's failure as this joiner's own error (same class, its own typed fields)."""
    why = f"the shared read {leader} failed after it filled this destination: {failure}"
    return type(failure)(why) if isinstance(failure, KvxferError) else UnavailableError(why)


class _Lead:
    """A leading pull's handle: ``serve_joiners`` before done, ``ended`` with its outcome."""

    def __init__(self, reads: SharedReads, key: bytes, group: _Group) -> None:
        self._reads, self._key, self._group = reads, key, group

    async def serve_joiners(self) -> int:
        return await self._reads._serve(self._key, self._group)

    def ended(self, failure: BaseException | None) -> None:
        self._reads._end(self._key, self._group, failure)
