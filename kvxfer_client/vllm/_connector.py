"""``KvxferConnector``: vLLM's KV connector API over kvxferd, for both roles.

vLLM builds one instance in the scheduler process (role SCHEDULER) and one per worker (role
WORKER); the scheduler's hooks go to :class:`~._plan.SchedulerPlan`, the workers' to
:class:`~._worker.WorkerTransfers`. Configuration, all optional, in
``kv_connector_extra_config``: ``socket`` (the daemon's engine socket; default as for
:class:`~kvxfer_client.KvxferClient`), ``lease_s`` (how long a prefill's blocks wait for their
pull, 60), ``pull_timeout_s`` (60).

Two modes, chosen per request by the router (see :mod:`._plan`): *pull* (the prefill answers
with tickets, the decode engine pulls the whole request after the prefill) and *streaming*
(both engines get the request at once; the prefill pushes each layer as the forward pass
writes it). The layer hooks, for streaming:

* ``save_kv_layer``: the layer is written (on a GPU: once the work queued so far on the
  current stream is done, which a CUDA event tells a helper thread); the daemon may send it.
  Never waits on the daemon.
* ``wait_for_save``: the step's pushes have all their layers written; returns without
  waiting for the transfer (the blocks stay with vLLM until the push ends: finished sending).
* ``wait_for_layer_load``: nothing to do. The decode side loads asynchronously (a request
  is scheduled once all of its KV has landed), so no forward pass waits on a layer.

Under full CUDA graphs vLLM skips the layer hooks: a push then goes at ``wait_for_save``,
whole, which is correct but does not overlap the prefill.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvxfer.layout import ModelInfo
from kvxfer.ticket import Ticket

from .._blocking import KvxferClient
from .._results import PoolRef
from ._config_facts import backend_name, backend_shape, head_facts, kv_dtype, total_kv_heads
from ._extra_config import settings
from ._groups import GROUPS_KEY, offered
from ._kv_events import WorkerEvents
from ._leases import LeaseKeeper
from ._messages import STREAM_KEY, TICKETS_KEY, UNAVAILABLE_KEY
from ._metadata import KvxferHandshake, KvxferMetadata, KvxferWorkerMeta
from ._plan import SchedulerPlan
from ._readiness import PoolsBack
from ._refusals import RefusedOffers
from ._stats import KvxferStats
from ._tier_side import TierSide
from ._worker import WorkerTransfers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvxferConnector", "KvxferHandshake", "KvxferMetadata", "KvxferWorkerMeta"]

#: A child of vLLM's logger, so these lines go where vLLM's own go.
log = logging.getLogger("vllm.kvxfer")


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    """Both roles (module docstring). ``SupportsHMA``: vLLM's hybrid KV-cache manager stays on,
    and a model with several KV-cache groups hands off every group in pull mode
    (:mod:`._groups`); streaming and the node's tier serve single-group models."""

    #: Loaded tokens come from another engine (vLLM's cache-hit metrics by source).
    _cache_hit_source = CacheHitSource.P2P

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 asks): sleep mode remaps the KV caches in VMM memory, which the daemon
        cannot map yet, and a re-registered pool would need a new handshake with the scheduler."""
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = settings(self._kv_transfer_config.kv_connector_extra_config or {}, role)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._plan: SchedulerPlan | None = None
        self._worker: WorkerTransfers | None = None
        self._handshake: KvxferHandshake | None = None
        self._socket = str(extra["socket"])
        self._lease_s = float(extra["lease_s"])
        self._idle_wait_s = float(extra["idle_wait_s"])
        self._offerer: KvxferClient | None = None
        #: Decode side: keeps the offers of requests waiting here alive (see ._leases).
        self._leases: LeaseKeeper | None = None
        #: Offers the daemon refused: their blocks go back to vLLM (see ._refusals).
        self._refusals: RefusedOffers | None = None
        #: Whether the workers' pools are back after a daemon restart (see ._readiness), and
        #: on the worker side, when it last said its own was.
        self._back: PoolsBack | None = None
        self._told_restored = 0.0
        #: KV-cache groups (vLLM's hybrid manager: sliding-window layers beside full ones).
        self._groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        #: The node's KV tier (scheduler side), with vLLM's KV events of what it holds when
        #: vLLM publishes them (``--kv-events-config``).
        self._tier: TierSide | None = None
        self._tier_salt = str(extra["tier_salt"]).encode()
        if extra["tier"] and self._groups > 1:
            log.warning("kvxfer: the node's KV tier serves models of one KV-cache group; off for this one")
        elif extra["tier"]:
            events = getattr(vllm_config, "kv_events_config", None)
            publish = bool(events is not None and events.enable_kv_cache_events)
            self._tier = TierSide(self._block_size, self._tier_salt, self._lease_s, publish)
        if role == KVConnectorRole.SCHEDULER:
            decode_tp = int(extra["decode_tp_size"] or vllm_config.parallel_config.tensor_parallel_size)
            self._plan = SchedulerPlan(self._block_size, total_kv_heads(vllm_config), decode_tp)
        else:
            parallel = vllm_config.parallel_config
            self._worker = WorkerTransfers(
                self._socket,
                engine_name=f"vllm-{self._kv_transfer_config.kv_role}",
                tp_rank=int(getattr(parallel, "rank", 0)) % max(1, int(parallel.tensor_parallel_size)),
                tp_size=max(1, int(parallel.tensor_parallel_size)),
                lease_s=self._lease_s,
                pull_timeout_s=float(extra["pull_timeout_s"]),
            )

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        config = self._vllm_config
        model = ModelInfo(
            model=str(config.model_config.model),
            dtype=kv_dtype(config),
            block_tokens=self._block_size,
            tp_size=int(config.parallel_config.tensor_parallel_size),
            tp_rank=self._worker.tp_rank,
        )
        num_blocks = int(self._kv_cache_config.num_blocks)
        shape = backend_shape(config, self._kv_cache_config)
        heads = head_facts(config, self._kv_cache_config)
        pool = self._worker.register(kv_caches, num_blocks, model, shape, heads, backend_name(config))
        self._handshake = KvxferHandshake(pool)

    def get_handshake_metadata(self) -> KvxferHandshake | None:
        return self._handshake

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KvxferMetadata) and meta.unoffered:
            self._worker.forget(meta.unoffered)
        if isinstance(meta, KvxferMetadata) and (meta.loads or meta.sends or meta.streams or meta.cancels):
            self._worker.start(meta.loads, meta.sends, meta.streams, meta.cancels)
        if isinstance(meta, KvxferMetadata) and (meta.tier_loads or meta.tier_saves):
            self._worker.start_tier(meta.tier_loads, meta.tier_saves, self._tier_salt)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs once all its KV landed

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.pushes.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.pushes.step_saved()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What finished since the last step; a step with nothing to compute first sleeps up to
        ``idle_wait_s`` for a transfer to end (why: :mod:`._loads`)."""
        assert self._worker is not None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, KvxferMetadata) and meta.idle and self._idle_wait_s > 0:
            self._worker.wait_for_any(self._idle_wait_s)
        sending, receiving, failed = self._worker.poll()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=receiving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_kv_cache_events(self) -> WorkerEvents | None:
        """This worker's tier stores and loads that landed since the last step, as vLLM's KV
        events (the scheduler publishes each once every rank gave it back)."""
        if self._worker is None or not self._worker.kv_events:
            return None
        reports, self._worker.kv_events = self._worker.kv_events, []
        return WorkerEvents(reports)

    def build_connector_worker_meta(self) -> KvxferWorkerMeta | None:
        """Once after this worker's pool was registered again (its daemon restarted): when
        (the scheduler hands out tickets again once every rank said so: :mod:`._readiness`)."""
        if self._worker is None or self._worker.client.restored_at == self._told_restored:
            return None
        self._told_restored = self._worker.client.restored_at
        return KvxferWorkerMeta({self._worker.tp_rank: self._told_restored})

    def get_kv_connector_stats(self) -> KvxferStats | None:
        """This worker's counters since the last step (None in the scheduler, or when idle)."""
        if self._worker is None:
            return None
        stats = KvxferStats(self._worker.take_stats())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxferStats:
        return KvxferStats(data)

    def shutdown(self) -> None:
        if self._leases is not None:
            self._leases.close()
        if self._worker is not None:
            self._worker.close()
        if self._offerer is not None:
            self._offerer.close()

    # -- scheduler side -------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._plan is not None
        self._plan.set_pools({rank: m.pool for rank, m in metadata.items() if isinstance(m, KvxferHandshake)})
        if self._plan.pools and self._offerer is None:
            # The scheduler's own session: it offers the workers' blocks (with their pools'
            # offer keys) the moment a request finishes, without waiting for the reply, and
            # keeps the offers a decode request waits for alive. It outlives daemon restarts
            # (the workers' pools keep their ids and keys).
            self._offerer = KvxferClient(self._socket, engine_name="vllm-scheduler", auto_reconnect=True, logger=log)
            offerer, lease_s = self._offerer, self._lease_s

            def renew(ticket: dict[str, Any]) -> None:
                future = offerer.start_extend_lease(ticket, lease_s)
                future.add_done_callback(functools.partial(_log_renewal, str(ticket.get("offer_id", ""))))

            self._leases = LeaseKeeper(renew, lease_s).start()
            self._refusals = RefusedOffers(offerer.start_release)
            self._back = PoolsBack(len(self._plan.pools))
        if self._tier is not None and self._offerer is not None and self._plan.pools:
            self._tier.connect(self._offerer, self._plan.pools)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._plan is not None
        told = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(told, KvxferWorkerMeta) and self._back is not None:
            self._back.heard(told.restored)
        self._plan.received(connector_output.finished_recving or ())
        if self._leases is not None:
            self._leases.release(connector_output.finished_recving or ())
        if self._tier is not None:
            self._tier.landed(connector_output, len(self._plan.pools))
        unoffered = self._refusals.take() if self._refusals is not None else set()
        if connector_output.finished_sending or unoffered:
            finished = set(connector_output.finished_sending or ()) | unoffered
            connector_output.finished_sending = self._plan.sent(finished)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._plan is not None
        matched = self._plan.matched_tokens(request.kv_transfer_params, request.num_prompt_tokens, num_computed_tokens)
        params = request.kv_transfer_params
        if matched[0] and self._leases is not None and params:  # kept alive while it waits
            tickets = params.get(TICKETS_KEY)
            self._leases.claim(request.request_id, tickets if isinstance(tickets, list) else ())
        if matched[0] or self._tier is None or _remote(request.kv_transfer_params):
            return matched
        return self._tier.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._plan is not None
        if len(blocks.blocks) > 1:  # several KV-cache groups: pulled group by group
            params = request.kv_transfer_params
            if params and params.get(STREAM_KEY) is not None and params.get("do_remote_decode"):
                log.warning("kvxfer: request %s does not stream (several KV-cache groups): a pull", request.request_id)
            if num_external_tokens:
                dst = [[None if b.is_null else b.block_id for b in group] for group in blocks.blocks]
                fresh = [[b.block_hash is None for b in group] for group in blocks.blocks]
                self._plan.after_alloc_groups(request.request_id, params, dst, fresh)
            return
        self._plan.expect_stream(request.request_id, request.kv_transfer_params, request.num_prompt_tokens)
        block_ids = list(blocks.get_block_ids()[0]) if num_external_tokens else []
        new = len(blocks.get_unhashed_block_ids()) if num_external_tokens else 0
        self._plan.after_alloc(request.request_id, request.kv_transfer_params, block_ids, num_external_tokens, new)
        if self._tier is not None:
            self._tier.plan.after_alloc(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvxferMetadata:
        assert self._plan is not None
        cached = scheduler_output.scheduled_cached_reqs
        self._plan.schedule_streams(
            [(r.req_id, list(r.block_ids[0]), r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs],
            [
                (rid, list(ids[0]) if ids else None, computed, rid in cached.resumed_req_ids)
                for rid, ids, computed in zip(
                    cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
                )
            ],
            dict(scheduler_output.num_scheduled_tokens),
        )
        loads, sends = self._plan.take()
        streams, cancels = self._plan.take_streams()
        tier_loads, tier_saves = self._tier.take() if self._tier is not None else ([], [])
        meta = KvxferMetadata(loads, sends, streams, cancels, tier_loads, tier_saves)
        meta.unoffered = self._refusals.for_workers() if self._refusals is not None else []
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with each KV-cache group's blocks (``SupportsHMA``): one group
        goes as ever; several are offered in one offer, group after group, their spans in
        ``kvxfer_groups`` (a request that cannot be handed off is computed by the decode
        engine: its blocks are freed here at once)."""
        if len(block_ids) == 1:
            return self.request_finished(request, block_ids[0])
        try:
            spans, ids = offered(block_ids)
        except ValueError as exc:
            log.warning("kvxfer: request %s: no KV handed off: %s", request.request_id, exc)
            return False, {"do_remote_prefill": False, "do_remote_decode": False, UNAVAILABLE_KEY: str(exc)}
        delay, params = self.request_finished(request, ids)
        if params is not None and params.get(TICKETS_KEY):
            params[GROUPS_KEY] = spans
        return delay, params

    def take_events(self) -> list[Any]:
        """The tier's stores and loads every rank finished, as vLLM's KV events (._kv_events)."""
        return self._tier.take_events() if self._tier is not None else []

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._plan is not None
        if self._leases is not None:
            self._leases.release([request.request_id])
        offerer, daemon, away = self._offerer, None, ""
        back = self._back is None or offerer is None or self._back.ready(offerer.lost_at, time.monotonic())
        if offerer is not None and offerer.connected and back:
            daemon = (offerer.daemon_id, offerer.peer_address)
        elif offerer is not None and offerer.connected:
            away = f"kvxferd at {self._socket} is back, but this engine's workers have not yet registered their KV"
            away += " with it again; the decode engine computes this prompt itself"
        elif offerer is not None:
            away = f"kvxferd at {self._socket} is away (restarting?); the decode engine computes this prompt itself"
        delay, params, send = self._plan.finished(
            request.request_id, request.kv_transfer_params, list(block_ids), daemon, away
        )
        if away and params and UNAVAILABLE_KEY in params:
            log.warning("kvxfer: request %s: no KV handed off: %s", request.request_id, away)
        if not delay and send is None and self._tier is not None and not _remote(request.kv_transfer_params):
            # Kept for the next turn: the blocks wait until every worker stored its heads.
            delay = self._tier.finished(request, list(block_ids))
        if send is not None:
            assert self._offerer is not None
            offers = []
            for rank, pool in sorted(self._plan.pools.items()):
                if send.readers and not send.readers[rank]:
                    continue  # a replica of heads no decode rank takes: its worker frees at once
                offer = self._offerer.start_offer(
                    PoolRef(pool.pool_id, bytes.fromhex(pool.offer_key)),
                    send.block_ids,
                    lease_s=self._lease_s,
                    ticket=Ticket.from_dict(send.tickets[rank]),
                )
                offers.append(offer)
            assert self._refusals is not None
            self._refusals.watch(request.request_id, offers)
        if delay:
            self._plan.hold(request.request_id)
        return delay, params


def _log_renewal(offer_id: str, future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("kvxfer: could not renew the lease of offer %s: %s", offer_id, future.exception())


def _remote(params: dict[str, Any] | None) -> bool:
    """A request of a disaggregated pair (its KV comes from, or goes to, another engine)."""
    return bool(params and (params.get("do_remote_decode") or params.get("do_remote_prefill")))
