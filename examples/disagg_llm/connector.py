"""The example engine's KV connector: an engine-facing adapter in the shape of a serving
engine's KV-connector split, built on the public SDK only (the vLLM connector,
:mod:`kvxfer_client.vllm`, is the production one).

Serving engines divide KV transfer work between a **scheduler side** (decides which requests
load or send KV, owns block allocation, never touches KV memory) and a **worker side** (moves
the bytes, reports what finished). :class:`ConnectorScheduler` and :class:`ConnectorWorker`
follow that split, so an engine's connector plugin is a thin layer that forwards its hooks:

Prefill engine, when a request finishes its prompt::

    delay_free, params = scheduler.request_finished(req_id, block_ids, num_tokens)
    # keep the blocks until worker.get_finished() lists req_id in its first set
    # return `params` (JSON-serialisable) to whoever routes the request to a decode engine

Decode engine, when a request arrives with those ``kv_transfer_params``::

    n = scheduler.get_num_new_matched_tokens(req_id, params)      # tokens it need not compute
    scheduler.update_state_after_alloc(req_id, params, block_ids)  # after allocating blocks
    worker.start_load_kv(scheduler.build_connector_meta())         # once per engine step
    sending, receiving = worker.get_finished()                     # each step; ready requests
    failed = worker.get_failed()                                   # req_id -> KvxferError

Both sides take callbacks too (``on_load_done``, ``on_load_failed``, ``on_send_done``), called
on the client's thread, for engines that prefer being told to polling.

>>> params = {"do_remote_prefill": True, "num_tokens": 37, "kvxfer_ticket": {"v": 1}}
>>> ConnectorScheduler.tokens_in(params)
37
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.errors import CancelledError, InternalError, InvalidRequestError, KvxferError
from kvxfer.ticket import Ticket
from kvxfer_client import KvxferClient, OfferReleased, Pool, PullResult, ReleaseReason

__all__ = ["ConnectorMetadata", "ConnectorScheduler", "ConnectorWorker", "LoadSpec", "SendSpec"]

#: Key of the ticket inside ``kv_transfer_params``.
TICKET_KEY = "kvxfer_ticket"


@dataclass(frozen=True)
class LoadSpec:
    """One decode request whose KV must be pulled into ``block_ids`` of the local pool."""

    request_id: str
    ticket: Ticket
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SendSpec:
    """One prefill request whose blocks stay pinned until its offer is released."""

    request_id: str
    offer_id: str


@dataclass(frozen=True)
class ConnectorMetadata:
    """What the scheduler side hands the worker side for one engine step."""

    loads: tuple[LoadSpec, ...] = ()
    sends: tuple[SendSpec, ...] = ()


@dataclass
class ConnectorScheduler:
    """Scheduler side: offers finished prefills, plans loads for arriving decode requests.

    ``lease_s`` is how long an offer waits for its pull (0: the daemon's default).
    """

    client: KvxferClient
    pool: Pool | str
    lease_s: float = 0.0
    _loads: list[LoadSpec] = field(default_factory=list)
    _sends: list[SendSpec] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- prefill side -------------------------------------------------------------------
    def request_finished(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int, readers: int = 1
    ) -> tuple[bool, dict[str, Any] | None]:
        """Offer the request's blocks; returns ``(delay_free, kv_transfer_params)``.

        ``delay_free`` is True: the engine must not reuse ``block_ids`` until the worker side
        reports the request in its finished-sending set. ``readers``: the decode ranks that
        each pull their heads of it (a decode side of larger tensor-parallel size).
        """
        if num_tokens <= 0 or not block_ids:
            return False, None
        ticket = self.client.offer(self.pool, list(block_ids), lease_s=self.lease_s, readers=readers)
        with self._lock:
            self._sends.append(SendSpec(request_id, ticket.offer_id))
        return True, {"do_remote_prefill": True, "num_tokens": num_tokens, TICKET_KEY: ticket.to_dict()}

    # -- decode side --------------------------------------------------------------------
    @staticmethod
    def tokens_in(kv_transfer_params: dict[str, Any] | None) -> int:
        """Tokens of KV the params point at (0 when they carry no kvxfer ticket)."""
        if not kv_transfer_params or TICKET_KEY not in kv_transfer_params:
            return 0
        n = kv_transfer_params.get("num_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidRequestError(f"kv_transfer_params num_tokens must be a non-negative int, got {n!r}")
        return n

    def get_num_new_matched_tokens(
        self, request_id: str, kv_transfer_params: dict[str, Any] | None, num_computed_tokens: int = 0
    ) -> int:
        """Tokens the decode engine can take from the remote prefill instead of computing."""
        return max(0, self.tokens_in(kv_transfer_params) - num_computed_tokens)

    def update_state_after_alloc(
        self, request_id: str, kv_transfer_params: dict[str, Any] | None, block_ids: Sequence[int]
    ) -> None:
        """Plan the pull into the blocks the engine just allocated (their first
        ``ticket.num_blocks`` take the remote blocks, in order)."""
        if self.tokens_in(kv_transfer_params) == 0:
            return
        assert kv_transfer_params is not None
        ticket = Ticket.from_dict(kv_transfer_params[TICKET_KEY])
        if len(block_ids) < ticket.num_blocks:
            raise InvalidRequestError(
                f"request {request_id}: {len(block_ids)} blocks allocated, the ticket holds {ticket.num_blocks}"
            )
        with self._lock:
            self._loads.append(LoadSpec(request_id, ticket, tuple(int(b) for b in block_ids[: ticket.num_blocks])))

    def build_connector_meta(self) -> ConnectorMetadata:
        """Everything planned since the last call, for :meth:`ConnectorWorker.start_load_kv`."""
        with self._lock:
            meta = ConnectorMetadata(tuple(self._loads), tuple(self._sends))
            self._loads.clear()
            self._sends.clear()
        return meta


class ConnectorWorker:
    """Worker side: runs the pulls, watches the offers, reports what finished or failed.

    Callbacks run on the client's thread and must not block; ``get_finished`` and
    ``get_failed`` are the polling alternative (thread-safe, each result reported once).
    """

    def __init__(
        self,
        client: KvxferClient,
        pool: Pool | str,
        *,
        load_timeout_s: float = 30.0,
        release_timeout_s: float | None = 600.0,
        on_load_done: Callable[[str, PullResult], None] | None = None,
        on_load_failed: Callable[[str, KvxferError], None] | None = None,
        on_send_done: Callable[[str, OfferReleased], None] | None = None,
    ) -> None:
        if load_timeout_s <= 0:
            raise ValueError("load_timeout_s must be positive")
        self.client = client
        self.pool = pool
        self.load_timeout_s = load_timeout_s
        self.release_timeout_s = release_timeout_s
        self._on_load_done = on_load_done
        self._on_load_failed = on_load_failed
        self._on_send_done = on_send_done
        self._lock = threading.Lock()
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed: dict[str, KvxferError] = {}
        self._release_reasons: dict[str, ReleaseReason] = {}
        self._inflight: dict[str, concurrent.futures.Future[Any]] = {}

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Start this step's pulls and begin watching its offers; returns at once."""
        for load in meta.loads:
            fut = self.client.start_pull(
                load.ticket, self.pool, list(load.block_ids), transfer_id="", timeout_s=self.load_timeout_s
            )
            self._track(load.request_id, fut, self._load_finished)
        for send in meta.sends:
            watch = self.client.watch_release(send.offer_id, self.release_timeout_s)
            self._track(send.request_id, watch, self._send_finished)

    def _track(
        self,
        request_id: str,
        fut: concurrent.futures.Future[Any],
        done: Callable[[str, concurrent.futures.Future[Any]], None],
    ) -> None:
        with self._lock:
            self._inflight[request_id] = fut
        fut.add_done_callback(lambda f: done(request_id, f))

    def _load_finished(self, request_id: str, fut: concurrent.futures.Future[PullResult]) -> None:
        with self._lock:
            self._inflight.pop(request_id, None)
        try:
            result = fut.result()
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, typed
            err = _as_kvxfer_error(exc)
            with self._lock:
                self._failed[request_id] = err
            if self._on_load_failed is not None:
                self._on_load_failed(request_id, err)
            return
        with self._lock:
            self._done_recving.add(request_id)
        if self._on_load_done is not None:
            self._on_load_done(request_id, result)

    def _send_finished(self, request_id: str, fut: concurrent.futures.Future[OfferReleased]) -> None:
        with self._lock:
            self._inflight.pop(request_id, None)
        try:
            released = fut.result()
        except BaseException as exc:  # noqa: BLE001
            # The daemon or the session is gone: it no longer holds the blocks either.
            released = OfferReleased("", "", ReleaseReason.UNKNOWN, detail=str(_as_kvxfer_error(exc)))
        with self._lock:
            self._done_sending.add(request_id)
            self._release_reasons[request_id] = released.reason
        if self._on_send_done is not None:
            self._on_send_done(request_id, released)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` since the last call.

        A request in the first set may have its prefill blocks freed (whatever the release
        reason: see :meth:`release_reason`); one in the second has its KV in place.
        """
        with self._lock:
            sending, recving = self._done_sending, self._done_recving
            self._done_sending, self._done_recving = set(), set()
        return sending, recving

    def get_failed(self) -> dict[str, KvxferError]:
        """Loads that failed since the last call: the engine recomputes or aborts them.

        The daemon cancels a failed pull's receives before it answers, so their destination
        blocks can be reused, except when the error's ``may_still_write`` is True (UCX did
        not confirm the cancel): keep those blocks out of use until the pool goes away.
        """
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def release_reason(self, request_id: str) -> ReleaseReason | None:
        """Why the offer of a finished-sending request was released (``pulled`` normally)."""
        with self._lock:
            return self._release_reasons.pop(request_id, None)

    def pending(self) -> int:
        """Loads and sends still in flight."""
        with self._lock:
            return len(self._inflight)


def _as_kvxfer_error(exc: BaseException) -> KvxferError:
    if isinstance(exc, KvxferError):
        return exc
    if isinstance(exc, concurrent.futures.CancelledError):
        return CancelledError("the load was cancelled")
    return InternalError(f"unexpected {type(exc).__name__}: {exc}")
