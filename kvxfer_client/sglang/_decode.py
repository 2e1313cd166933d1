"""The decode rank's half of the backend: the receives that land a request's pages.

When SGLang has allocated a request's pages (``send_metadata``), this side tells each prefill
rank the request comes from where to push, under a nonce of its own, and expects from the
first of them the metadata row, and a hybrid model's state rows (:mod:`._state`). Each
prefill rank then pushes the request's pages chunk by chunk as SGLang prefills them, saying
which pages each push fills (``KVXFER_CHUNK``); this side expects each such push into those
pages (kvxfer's ``receive``: the decode daemon lands the pushed pages, mapping heads where the
tensor parallelism differs). The request has succeeded once every prefill rank announced all
of its pages and every receive returned: the bytes are in this rank's memory and were
checked. A receive that fails fails the request with its typed error as the reason; a request
that fails otherwise (its prefill rank's word, a lost heartbeat, an abort, a timeout) cancels
the receives it still has.
"""

from __future__ import annotations

import concurrent.futures
import functools
import secrets
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .._results import PullResult
from ._messages import Chunk, RoomInfo

if TYPE_CHECKING:
    from ._conn import KvxferKVManager

__all__ = ["DecodeReceives"]


@dataclass
class _Receives:
    """A request's receives still running (transfer ids), and how many of its pages each
    prefill rank (by nonce) announced so far."""

    pages: np.ndarray[Any, Any]
    announced: dict[str, int]
    pending: set[str] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return not self.pending and all(n == len(self.pages) for n in self.announced.values())


class DecodeReceives:
    """The receives of every request in flight on this decode rank."""

    def __init__(self, mgr: KvxferKVManager) -> None:
        self.mgr = mgr
        self.rooms: dict[int, _Receives] = {}
        self.lock = threading.Lock()

    def expect(self, request: RoomInfo, sources: int) -> list[RoomInfo]:
        """Start the receives of ``request`` from ``sources`` prefill ranks (the metadata row
        from the first; state moved row for row from the one rank with this rank's shard,
        mappable state from each) and return what to tell each of them, a nonce each. The
        pages are expected chunk by chunk, as each prefill rank announces them."""
        mgr, room = self.mgr, request.room
        infos = [
            replace(request, nonce=secrets.token_hex(16), want_aux=i == 0, dst_states=_states_from(mgr, request, i))
            for i in range(sources)
        ]
        receives: list[tuple[str, Any, list[int]]] = []
        for info in infos:
            if info.want_aux:
                receives.append((info.transfer_id("aux"), mgr.aux_pool, [info.aux_index]))
            for state, rows in zip(mgr.states, info.dst_states, strict=True):
                if len(rows):
                    receives.append((info.transfer_id(f"state-{state.kind}"), state.pool, rows.tolist()))
        with self.lock:
            announced = {info.nonce: 0 for info in infos}
            self.rooms[room] = _Receives(request.dst_pages, announced, {t for t, _, _ in receives})
        for transfer_id, pool, ids in receives:
            self._start(room, transfer_id, pool, ids)
        return infos

    def expect_chunk(self, chunk: Chunk) -> None:
        """A prefill rank pushes pages ``chunk.start`` on of a request: expect the push into
        those pages. A chunk out of order or past the request's pages fails the request."""
        with self.lock:
            receives = self.rooms.get(chunk.room)
            if receives is None or chunk.nonce not in receives.announced:
                return  # a request that ended meanwhile, or a nonce it never gave: not ours
            expected, end = receives.announced[chunk.nonce], chunk.start + chunk.count
            in_order = chunk.start == expected and end <= len(receives.pages)
            if in_order:
                receives.announced[chunk.nonce] = end
                receives.pending.add(chunk.transfer_id())
            ids = receives.pages[chunk.start : end].tolist()
        if not in_order:
            why = f"a prefill rank pushes pages {chunk.start}-{end}; this rank expected page {expected} next"
            self.fail(chunk.room, f"{why}, of {len(receives.pages)}")
            return
        self._start(chunk.room, chunk.transfer_id(), self.mgr.kv_pool, ids)

    def _start(self, room: int, transfer_id: str, pool: Any, ids: list[int]) -> None:
        future = self.mgr.client.start_receive(transfer_id, pool, ids, timeout_s=self.mgr.waiting_timeout)
        future.add_done_callback(functools.partial(self._landed, room, transfer_id))

    def _landed(self, room: int, transfer_id: str, future: concurrent.futures.Future[PullResult]) -> None:
        """One receive ended (client thread)."""
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - the typed error is the request's failure reason
            self.fail(room, f"{type(exc).__name__}: {exc}")
            return
        with self.lock:
            receives = self.rooms.get(room)
            if receives is None:
                return
            receives.pending.discard(transfer_id)
            done = receives.done
            if done:
                del self.rooms[room]
        if done:
            self.mgr.update_status(room, _poll().Success)

    def fail(self, room: int, why: str) -> None:
        """Fail the request (first reason kept) and cancel the receives it still has."""
        self.cancel(room)
        if room in self.mgr.request_status:
            with self.mgr.failure_lock:
                self.mgr.failure_records.setdefault(room, why)
            self.mgr.update_status(room, _poll().Failed)

    def cancel(self, room: int) -> None:
        with self.lock:
            receives = self.rooms.pop(room, None)
        for transfer_id in receives.pending if receives is not None else ():
            self.mgr.client.start_cancel(transfer_id)


def _states_from(mgr: KvxferKVManager, request: RoomInfo, source: int) -> tuple[np.ndarray[Any, Any], ...]:
    """The state rows to ask of the ``source``-th prefill rank: mappable state from each, the
    rest from the first (the only one, at equal TP); none is an empty list."""
    return tuple(
        rows if state.mappable or source == 0 else rows[:0]
        for state, rows in zip(mgr.states, request.dst_states, strict=True)
    )


def _poll() -> Any:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return KVPoll
