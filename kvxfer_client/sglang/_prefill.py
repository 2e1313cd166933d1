"""The prefill rank's half of the backend: the decode ranks' destinations, and the pushes.

A decode rank registers once (:class:`~._messages.Registration`: where its daemon is) and
then names, per request, the pages it allocated (:class:`~._messages.RoomInfo`). Once every
decode rank SGLang expects for the request has (``required``), the request may run its
prefill (``KVPoll.WaitingForInput``). SGLang then hands the prefilled pages over chunk by
chunk (``add_transfer_request``), and this side pushes each chunk at once, each decode rank's
share into its pages (kvxfer's push: an announcement to that rank's daemon, which pulls),
telling the rank which of its pages the push fills (``KVXFER_CHUNK``): the bytes move while
the next chunk is computed. With the last chunk go the request's metadata row, to the one
rank that asked for it, and a hybrid model's state rows, to each rank that named rows for
them. The request has
succeeded when the daemon released every push's offer as pulled; any other release fails
it with the daemon's reason, which SGLang's status message carries to the decode side.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer.errors import KvxferError

from .._events import OfferReleased, ReleaseReason
from .._results import PushResult
from ._messages import REG_TAG, ROOM_TAG, Chunk, Registration, RoomInfo, parse_registration, parse_room

if TYPE_CHECKING:
    from ._conn import KvxferKVManager

__all__ = ["PrefillPushes"]

logger = logging.getLogger("kvxfer_client.sglang")

ABORT_TAG = b"ABORT"


@dataclass
class _Pushes:
    """A request's pushes: how many so far, how many were pulled, the offers still held."""

    expected: int = 0
    pulled: int = 0
    #: Pages of the request pushed so far (where the next chunk starts).
    sent_pages: int = 0
    #: The last chunk was handed over: no more pushes come.
    last: bool = False
    #: Offer id -> transfer id, of pushes announced and not yet released.
    offers: dict[str, str] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.last and self.pulled == self.expected


class PrefillPushes:
    """Destinations by request, and the pushes running."""

    def __init__(self, mgr: KvxferKVManager) -> None:
        self.mgr = mgr
        self.peers: dict[str, Registration] = {}
        #: The pushes of a request until every one was pulled (or the request failed).
        self.running: dict[int, _Pushes] = {}
        #: Rooms of this rank's senders (destinations may come before the sender does).
        self.senders: set[int] = set()
        self.lock = threading.Lock()

    def on_message(self, frames: list[bytes]) -> None:
        """One message from a decode rank (SGLang's bootstrap thread); a malformed one is
        logged and dropped."""
        try:
            if frames and frames[0] == REG_TAG:
                reg = parse_registration(frames)
                self.peers[reg.session] = reg
            elif frames and frames[0] == ROOM_TAG:
                self._destination(parse_room(frames))
            elif frames and frames[0] == ABORT_TAG and len(frames) >= 2:
                room = int(frames[1].decode("ascii"))
                self.abort(room, "aborted by the decode side")
                if room not in self.senders:  # a room no request here has (yet): forget it
                    self.mgr.transfer_infos.pop(room, None)
                    self.mgr.request_status.pop(room, None)
            else:
                logger.warning("kvxfer: dropped a %d-frame message nobody sends this socket", len(frames))
        except (KvxferError, ValueError, UnicodeDecodeError) as exc:
            logger.warning("kvxfer: dropped a malformed message from a decode rank: %s", exc)

    def _destination(self, info: RoomInfo) -> None:
        mgr = self.mgr
        if info.session not in self.peers:
            logger.warning("kvxfer: request %d names decode rank %s, which never registered", info.room, info.session)
            return
        infos = mgr.transfer_infos.setdefault(info.room, {})
        infos[info.session] = info
        if len(infos) == info.required:
            mgr.req_to_decode_prefix_len[info.room] = info.decode_prefix_len
            mgr.update_status(info.room, _poll().WaitingForInput)

    def add(
        self,
        room: int,
        pages: np.ndarray[Any, Any],
        last: bool,
        aux_index: int | None,
        states: list[np.ndarray[Any, Any]],
    ) -> None:
        """A chunk of the request's prefilled pages, pushed at once; the last one also pushes
        the request's metadata row and state rows."""
        mgr = self.mgr
        if room not in mgr.request_status or mgr.check_status(room) == _poll().Failed:
            return
        infos: dict[str, RoomInfo] | None = mgr.transfer_infos.get(room)
        if not infos:
            return
        src = np.asarray(pages, dtype=np.int64)
        with self.lock:
            running = self.running.setdefault(room, _Pushes())
            start, running.sent_pages = running.sent_pages, running.sent_pages + len(src)
        try:
            pushes, chunks = self._pushes(infos, src, start, last, aux_index, states)
        except ValueError as exc:
            self._failed(room, str(exc))
            return
        with self.lock:
            running.expected += len(pushes)
            running.last = last
            done = running.done and self.running.pop(room, None) is not None
        for info, chunk in chunks:
            mgr.tell(info, chunk.to_frames())  # the decode rank expects this push
        for pool, ids, transfer_id, address in pushes:
            future = mgr.client.start_push(pool, ids, transfer_id, address, lease_s=mgr.lease_s)
            future.add_done_callback(functools.partial(self._announced, room, transfer_id))
        if done:  # a last chunk with nothing to push, everything before it pulled
            mgr.conclude_transfer(bootstrap_room=room, status=_poll().Success)

    def _pushes(
        self,
        infos: dict[str, RoomInfo],
        src: np.ndarray[Any, Any],
        start: int,
        last: bool,
        aux_index: int | None,
        states: list[Any],
    ) -> tuple[list[tuple[Any, list[int], str, str]], list[tuple[RoomInfo, Chunk]]]:
        """What to push to each decode rank for a chunk of pages from ``start``: its pages
        (and the chunk message that announces them), and with the ``last`` chunk the metadata
        row if it asked and the state rows it named; ValueError says why the two sides do not
        match."""
        mgr, ids = self.mgr, src.tolist()  # once for every decode rank's push
        pushes: list[tuple[Any, list[int], str, str]] = []
        chunks: list[tuple[RoomInfo, Chunk]] = []
        for info in infos.values():
            end, allocated = start + len(src), len(info.dst_pages)
            if end > allocated or (last and end != allocated):
                raise ValueError(f"this rank sends {end} pages; decode rank {info.session} allocated {allocated}")
            address = info.peer_address or self.peers[info.session].peer_address
            if len(src):
                chunks.append((info, Chunk(info.room, info.nonce, start, len(src))))
                pushes.append((mgr.kv_pool, ids, chunks[-1][1].transfer_id(), address))
            if last:
                pushes += self._last_pushes(info, address, aux_index, states)
        return pushes, chunks

    def _last_pushes(
        self, info: RoomInfo, address: str, aux_index: int | None, states: list[Any]
    ) -> list[tuple[Any, list[int], str, str]]:
        """The metadata row (if this decode rank asked for it) and the state rows it named."""
        mgr = self.mgr
        if len(info.dst_states) != len(mgr.states):
            raise ValueError(
                f"decode rank {info.session} names {len(info.dst_states)} state components, this rank has "
                f"{len(mgr.states)} (another model or SGLang version)"
            )
        pushes: list[tuple[Any, list[int], str, str]] = []
        if info.want_aux:
            if aux_index is None:
                raise ValueError("the request's metadata row is unknown")
            pushes.append((mgr.aux_pool, [aux_index], info.transfer_id("aux"), address))
        for state, rows, dst in zip(mgr.states, states, info.dst_states, strict=True):
            if not len(dst):
                continue  # the decode rank expects none of it from this rank
            if len(rows) != len(dst):
                raise ValueError(
                    f"this rank sends {len(rows)} rows of {state.kind!r} state; "
                    f"decode rank {info.session} allocated {len(dst)}"
                )
            pushes.append((state.pool, rows.tolist(), info.transfer_id(f"state-{state.kind}"), address))
        return pushes

    def _announced(self, room: int, transfer_id: str, future: concurrent.futures.Future[PushResult]) -> None:
        """The push is announced (client thread): wait for its offer's release."""
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001 - any failure of the call fails the request
            self._failed(room, f"push {transfer_id}: {exc}")
            return
        if result.mode != "push":
            self.mgr.client.start_release(result.ticket.offer_id)
            self._failed(room, f"the decode daemon did not take push {transfer_id}: {result.mode_reason}")
            return
        with self.lock:
            running = self.running.get(room)
            if running is None:  # aborted meanwhile
                self.mgr.client.start_release(result.ticket.offer_id)
                return
            running.offers[result.ticket.offer_id] = transfer_id
        self.mgr.update_status(room, _poll().Transferring)  # the decode daemon took it: moving
        released = self.mgr.client.watch_release(result.ticket.offer_id)
        released.add_done_callback(lambda f: self._released(room, result.ticket.offer_id, f))

    def _released(self, room: int, offer_id: str, future: concurrent.futures.Future[OfferReleased]) -> None:
        try:
            event = future.result()
        except Exception as exc:  # noqa: BLE001 - the session ended: the request cannot finish
            self._failed(room, f"offer {offer_id}: {exc}")
            return
        if event.reason != ReleaseReason.PULLED:
            self._failed(room, f"offer {offer_id} was released {event.reason.value}: {event.detail}")
            return
        with self.lock:
            running = self.running.get(room)
            if running is None or running.offers.pop(offer_id, None) is None:
                return
            running.pulled += 1
            done = running.done
            if done:
                del self.running[room]
        if done:
            self.mgr.conclude_transfer(bootstrap_room=room, status=_poll().Success)

    def _failed(self, room: int, why: str) -> None:
        self.abort(room, why)
        self.mgr.conclude_failure(bootstrap_room=room, failure_reason=why)

    def abort(self, room: int, why: str, tell_decode: bool = False) -> None:
        """Withdraw whatever the request still has on offer (nothing stays pinned);
        ``tell_decode``: say so to its decode ranks, which stop waiting for the pushes."""
        with self.lock:
            running = self.running.pop(room, None)
        for offer_id, transfer_id in (running.offers if running is not None else {}).items():
            self.mgr.client.start_cancel(transfer_id)
            self.mgr.client.start_release(offer_id)
        mgr = self.mgr
        if room in mgr.request_status and mgr.check_status(room) != _poll().Success:
            with mgr.failure_lock:  # the first reason is the root cause: keep it
                mgr.failure_records.setdefault(room, why)
            mgr.update_status(room, _poll().Failed)
            if tell_decode:
                targets = mgr._room_notify_targets(room)
                mgr.send_kv_status_message(
                    targets=targets, bootstrap_room=room, status=_poll().Failed, failure_reason=why
                )


def _poll() -> Any:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return KVPoll
