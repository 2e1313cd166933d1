"""The worker side of the vLLM connector: one per tensor-parallel rank, in the worker process.

It registers the rank's KV tensors with kvxferd as they are (CUDA tensors through IPC, CPU
tensors as the process's own memory; the layout read off the tensors), starts the pulls and
receives the scheduler planned, pushes the streams it planned (one layer of the pool per KV
tensor, said written as the forward pass leaves each attention layer), and reports what
finished: pulls and receives, and offers and pushes once they are released. It never waits
on the daemon inside a step (but for a push's answer at the step's end, one round trip
started at its beginning): calls run on the client's thread and are polled.

Failures: a pull that failed is reported as finished (vLLM then frees or recomputes) with its
blocks in the load errors; one that may still be written by the data plane
(``may_still_write``) is held back from vLLM until the daemon has had ``QUARANTINE_S`` to stop
the writes, so the blocks are never reused while a late write can land in them. A load's
deadline, and why a step with nothing to compute sleeps: :mod:`._loads`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping
from typing import Any

from kvxfer.errors import IncompatibleError, InvalidRequestError, KvxferError, OfferExpiredError, UnavailableError
from kvxfer.geometry import head_sources
from kvxfer.layout import ModelInfo
from kvxfer.ticket import Ticket

from .._blocking import KvxferClient
from .._results import Pool
from ._loads import Loading, failed_load, wait_for_any
from ._messages import Load, RankPool, Send, Stream, stream_id
from ._pushes import StepPushes, done, log_refusal
from ._tensors import HeadFacts, pool_layout
from ._tier import TierLoad, TierSave

__all__ = ["QUARANTINE_S", "RECONNECT_WAIT_S", "WorkerTransfers"]

log = logging.getLogger("vllm.kvxfer")

#: How long blocks a failed pull may still be written into are kept from vLLM.
QUARANTINE_S = 30.0
#: How long a load waits for this worker's session to kvxferd to come back (the daemon
#: restarting) before it fails; a restart takes a second or two.
RECONNECT_WAIT_S = 5.0


class WorkerTransfers:
    def __init__(
        self,
        socket_path: str,
        engine_name: str,
        tp_rank: int,
        lease_s: float,
        pull_timeout_s: float,
        tp_size: int = 1,
    ) -> None:
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        #: How long blocks a failed pull may still write are held back (see ``QUARANTINE_S``).
        self.quarantine_s = QUARANTINE_S
        self.lease_s = lease_s
        self.pull_timeout_s = pull_timeout_s
        #: Reconnects by itself when the daemon restarts and registers the same tensors again
        #: under the same pool id and offer key (the scheduler keeps offering with them).
        self.client = KvxferClient(socket_path, engine_name=engine_name, auto_reconnect=True, logger=log)
        self.pool: Pool | None = None
        self._loading: dict[str, Loading] = {}
        #: Loads that came while the daemon was away: started once it is back (see start).
        self._parked: dict[str, tuple[Load, float]] = {}
        #: What each finished request waits for before vLLM may free its blocks: its offer's or
        #: push's release, or its tier store.
        self._released: dict[str, tuple[str, concurrent.futures.Future[Any]]] = {}
        #: vLLM KV events of tier stores and loads under way, given back once they landed
        #: (``kv_events``, taken each step: see ._kv_events).
        self._events_due: dict[tuple[str, str], Any] = {}
        self.kv_events: list[tuple[str, str, Any]] = []
        self.load_errors: set[int] = set()
        self.pushes = StepPushes(self.client, lambda rid, future: self._released.__setitem__(rid, ("push", future)))
        #: Counters since the last :meth:`take_stats` (vLLM's connector stats, per step).
        self.stats = _zero_stats()
        #: The same counters since the start (never reset; what the tests and logs read).
        self.totals = _zero_stats()

    def register(
        self,
        kv_caches: Mapping[str, Any],
        num_blocks: int,
        model: ModelInfo,
        backend_shape: tuple[int, ...] | None = None,
        heads: HeadFacts | None = None,
        backend: str = "",
    ) -> RankPool:
        """Register the rank's KV tensors (one buffer per layer, in vLLM's layer order);
        ``backend_shape`` as :func:`block_dim_of` takes it; ``heads``: what vLLM says of the
        heads, to declare the pool's geometry (then other TP sizes can pull from it);
        ``backend``: the attention backend's name, for the pool's KV format."""
        # KV-cache groups of a hybrid model may share tensors (one layer of each group): each
        # memory once in the pool (a block id is one group's block in all of them).
        tensors = list({_address(t): t for t in kv_caches.values()}.values())
        self.pushes.register(list(kv_caches), getattr(tensors[0], "is_cuda", False))
        layout = pool_layout(tensors, num_blocks, model, backend_shape, heads, backend)
        geometry = layout.geometry
        self.pool = self.client.register_pool(tensors, layout, name=f"vllm-tp{self.tp_rank}")
        log.info(
            "kvxfer: registered %d KV tensors of TP rank %d as pool %s (%d blocks, %d regions, %d bytes per block, %s)",
            len(tensors),
            self.tp_rank,
            self.pool.pool_id,
            layout.num_blocks,
            len(layout.regions),
            layout.bytes_per_block,
            geometry or "no head geometry: other TP sizes cannot pull from it",
        )
        return RankPool(
            self.tp_rank,
            self.client.daemon_id,
            self.client.peer_address,
            self.pool.pool_id,
            self.pool.fingerprint,
            layout.bytes_per_block,
            self.pool.offer_key.hex(),
        )

    def start(
        self,
        loads: list[Load],
        sends: list[Send],
        streams: list[Stream] | tuple[Stream, ...] = (),
        cancels: list[str] | tuple[str, ...] = (),
    ) -> None:
        """Watch this step's offers (the scheduler made them), start its pulls and receives,
        and its pushes (their layers marked by ``pushes.layer_saved``), and cancel the receives
        of requests that ended; returns at once."""
        assert self.pool is not None, "register_kv_caches first"
        for transfer_id in cancels:
            self.client.start_cancel(stream_id(transfer_id, self.tp_rank)).add_done_callback(log_refusal)
        for stream in streams:
            push = self.client.start_push(
                self.pool,
                stream.block_ids,
                stream_id(stream.transfer_id, self.tp_rank),
                stream.to_peer_address,
                lease_s=self.lease_s,
                layers=self.pushes.layers,
            )
            self.pushes.started(stream.request_id, push)
            self._count("pushes")
        for send in sends:
            if send.readers and not send.readers[self.tp_rank]:
                self._released[send.request_id] = ("offer", done())  # nobody reads this rank's heads
                continue
            ticket = Ticket.from_dict(send.tickets[self.tp_rank])
            self._released[send.request_id] = ("offer", self.client.watch_release(ticket.offer_id))
            self._count("offers")
        now = time.monotonic()
        for load in loads:
            if not load.refused and not self.client.connected:  # its daemon restarting: wait a little
                self._parked[load.request_id] = (load, now + min(self.pull_timeout_s, RECONNECT_WAIT_S))
                log.info("kvxfer: request %s waits for kvxferd to come back (a restart?)", load.request_id)
                continue
            self._start_load(load)

    def _start_load(self, load: Load) -> None:
        """Start one load's pulls (or its receive); a load refused here is a failed load."""
        assert self.pool is not None, "register_kv_caches first"
        try:
            if load.refused:
                raise InvalidRequestError(load.refused)
            if not self.client.connected:  # still away after the wait: vLLM's policy applies
                raise UnavailableError(
                    f"kvxferd at {self.client.socket_path} is away (restarting?); the connector reconnects "
                    "by itself: check the daemon (systemctl status kvxferd)"
                )
            # Streamed: rank to rank, this rank's push (see ``stream_id``).
            sources = self.sources(len(load.tickets)) if not load.transfer_id else [self.tp_rank]
        except KvxferError as error:
            # Refused here, reported as a failed load (vLLM's policy then applies): an
            # exception out of a step would stop the engine.
            error.args = (f"request {load.request_id}: {error}",)
            self._loading[load.request_id] = Loading(load.request_id, load.block_ids, [failed_load(error)])
            return
        if load.transfer_id:  # streamed: this rank's push, whichever comes first
            receive = self.client.start_receive(
                stream_id(load.transfer_id, self.tp_rank),
                self.pool,
                load.block_ids,
                timeout_s=self.pull_timeout_s,
                offer_block_indices=load.offer_block_indices,
            )
            self._loading[load.request_id] = Loading(load.request_id, load.block_ids, [receive])
            return
        futures = [
            self.client.start_pull(
                Ticket.from_dict(load.tickets[rank]),
                self.pool,
                load.block_ids,
                timeout_s=self.pull_timeout_s,
                offer_block_indices=load.offer_block_indices,
            )
            for rank in sources
        ]
        self._loading[load.request_id] = Loading(load.request_id, load.block_ids, futures)

    def _unpark(self) -> None:
        """Start the loads that waited for the daemon, once it is back or their wait is over."""
        now = time.monotonic()
        for request_id, (load, until) in list(self._parked.items()):
            if self.client.connected or now > until:
                del self._parked[request_id]
                self._start_load(load)

    def forget(self, request_ids: list[str]) -> None:
        """Requests whose offer the daemon refused: vLLM has their blocks back already (the
        scheduler said so); nothing of theirs is left to watch."""
        for request_id in request_ids:
            _, future = self._released.pop(request_id, ("", None))
            if future is not None:
                future.cancel()

    def start_tier(self, loads: list[TierLoad], saves: list[TierSave], salt: bytes) -> None:
        """Store finished requests' blocks into the node's KV tier (each is reported finished
        sending once stored, or once the store failed: the cache only misses it) and load
        stored prefixes; returns at once."""
        assert self.pool is not None, "register_kv_caches first"
        for save in saves:
            store = self.client.start_tier_store(self.pool, save.block_ids, save.keys, salt=salt)
            self._released[save.request_id] = ("tier store", store)
            if save.event is not None:
                self._events_due[(save.request_id, "store")] = save.event
            self._count("tier_saves")
        for load in loads:  # the tier's offer of a stored prefix: pulled like a prefill's
            ticket = Ticket.from_dict(load.ticket)
            indices = tuple(range(len(load.block_ids))) if len(load.block_ids) < ticket.num_blocks else None
            pull = self.client.start_pull(
                ticket, self.pool, load.block_ids, timeout_s=self.pull_timeout_s, offer_block_indices=indices
            )
            self._loading[load.request_id] = Loading(load.request_id, load.block_ids, [pull], tier=True)
            if load.event is not None:
                self._events_due[(load.request_id, "load")] = load.event

    def sources(self, prefill_tp: int) -> list[int]:
        """The prefill ranks whose tickets this rank pulls (each its share of this rank's heads):
        its own rank when both sides have the same TP; by heads when the pool declares them."""
        geometry = self.pool.layout.geometry if self.pool is not None else None
        if geometry is not None:
            picks = head_sources(geometry.total_kv_heads, prefill_tp, self.tp_size, self.tp_rank)
            return [s.tp_rank for s in picks]
        if prefill_tp != self.tp_size:
            raise IncompatibleError(
                f"the prefill engine has tensor-parallel size {prefill_tp} (one ticket per rank), this decode engine "
                f"{self.tp_size}, and the KV tensors' heads could not be read to map them"
            )
        return [self.tp_rank]

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished sending, finished receiving, failed receiving)`` since the last poll;
        failed loads' blocks go to :attr:`load_errors`."""
        if self._parked:
            self._unpark()
        sending = {rid for rid, (_, f) in self._released.items() if f.done()}
        for rid in sending:
            what, future = self._released.pop(rid)
            error = future.exception()
            event = self._events_due.pop((rid, "store"), None) if what == "tier store" else None
            if event is not None and error is None:
                self.kv_events.append((rid, "store", event))
            if error is not None and what == "tier store":  # nothing is lost but the cache
                log.warning("kvxfer: request %s: its tier store failed (%s); the next turn recomputes it", rid, error)
            elif error is not None:  # the daemon's session ended: so did the offer (blocks freed)
                log.warning(
                    "kvxfer: request %s: its %s ended with the session to kvxferd (%s); its blocks are freed and a "
                    "decode engine still pulling it fails (its kv_load_failure_policy applies)",
                    rid,
                    what,
                    error,
                )
        receiving: set[str] = set()
        failed: set[str] = set()

        now = time.monotonic()
        self._give_up_overdue(now)
        for rid, loading in list(self._loading.items()):
            if not all(f.done() for f in loading.futures) or now < loading.held_until:
                continue
            errors = [e for e in (f.exception() for f in loading.futures) if e is not None]
            if any(isinstance(e, KvxferError) and e.may_still_write for e in errors) and not loading.held_until:
                loading.held_until = now + self.quarantine_s
                log.warning("kvxfer: pull for %s failed, may still write; blocks held %.0fs", rid, self.quarantine_s)
                continue
            error = errors[0] if errors else None
            del self._loading[rid]
            receiving.add(rid)
            self._count("pulls")
            if error is not None:
                failed.add(rid)
                self.load_errors.update(loading.block_ids)
                self._count("pull_failures")
                if isinstance(error, OfferExpiredError):  # a capacity signal, not a transport failure
                    self._count("pull_expired")
                    log.warning(
                        "kvxfer: request %s: the prefill's offer expired before this engine pulled it (%s): the decode "
                        "side is too slow to start pulls; raise lease_s in kv_connector_extra_config or add decode "
                        "capacity",
                        rid,
                        error,
                    )
                else:
                    log.warning(
                        "kvxfer: pull for request %s failed: %s (vLLM's kv_load_failure_policy applies)", rid, error
                    )
            else:
                results = [f.result() for f in loading.futures]
                self._count("pulled_bytes", sum(r.bytes for r in results))
                self._count("pull_seconds", max(r.duration_s for r in results))
                if loading.tier:
                    self._count("tier_loaded_blocks", len(loading.block_ids))
                    if (event := self._events_due.get((rid, "load"))) is not None:
                        self.kv_events.append((rid, "load", event))
            self._events_due.pop((rid, "load"), None)
        return sending, receiving, failed

    def _give_up_overdue(self, now: float) -> None:
        """Cancel and fail the loads with no answer past their deadline (see :mod:`._loads`)."""
        for rid, loading in self._loading.items():
            if loading.overdue(self.pull_timeout_s, now):
                loading.give_up(now)
                log.warning(
                    "kvxfer: request %s: its load had no answer from kvxferd at %s %.0f s after it started "
                    "(pull_timeout_s %.0f): cancelled and failed (vLLM's kv_load_failure_policy applies). Check that "
                    "the daemon is alive (systemctl status kvxferd) and what its log and kvxferctl transfers say",
                    rid,
                    self.client.socket_path,
                    now - loading.started,
                    self.pull_timeout_s,
                )

    def wait_for_any(self, timeout_s: float) -> None:
        """Sleep until one of this worker's transfers ends, or ``timeout_s`` passed (for steps
        with nothing to compute: see :mod:`._loads`)."""
        if self._parked and not self._loading and not self._released:
            time.sleep(timeout_s)  # only loads waiting for the daemon: they are retried next step
            return
        wait_for_any((f for _, f in self._released.values()), self._loading.values(), timeout_s)

    def take_stats(self) -> dict[str, Any]:
        """The counters since the last call; they start again from zero."""
        taken, self.stats = self.stats, _zero_stats()
        return taken

    def _count(self, key: str, value: float = 1) -> None:
        self.stats[key] += value
        self.totals[key] += value

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def close(self) -> None:
        self.pushes.close()
        self.client.close()


def _zero_stats() -> dict[str, Any]:
    return {
        "pulls": 0,
        "pull_failures": 0,
        "pull_expired": 0,
        "pulled_bytes": 0,
        "pull_seconds": 0.0,
        "offers": 0,
        "pushes": 0,
        "tier_saves": 0,
        "tier_loaded_blocks": 0,
    }


def _address(tensor: Any) -> Any:
    """Where a KV tensor's memory starts (torch, CuPy or numpy), or the tensor itself."""
    if hasattr(tensor, "data_ptr"):
        return int(tensor.data_ptr())
    interface = getattr(tensor, "__array_interface__", None) or getattr(tensor, "__cuda_array_interface__", None)
    return int(interface["data"][0]) if interface else id(tensor)
