"""The worker side of the vLLM connector: one per tensor-parallel rank, in the worker process.

It registers the rank's KV tensors with kvxferd as they are (CUDA tensors through IPC, CPU
tensors as the process's own memory; the layout read off the tensors), starts the pulls the
scheduler planned, and reports what finished: pulls, and the offers the scheduler made of its
blocks once they are released. It never waits on the
daemon inside a step: offers and pulls run on the client's thread and are polled.

Failures: a pull that failed is reported as finished (vLLM then frees or recomputes) with its
blocks in the load errors; one that may still be written by the data plane
(``may_still_write``) is held back from vLLM until the daemon has had ``QUARANTINE_S`` to stop
the writes, so the blocks are never reused while a late write can land in them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._blocking import KvxferClient
from .._client import Pool, PullResult
from .._errors import KvxferError
from .._events import OfferReleased
from .._layout import ModelInfo
from .._tensor_layout import layout_from_tensors, tensor_geometry
from .._ticket import Ticket
from ._plan import Load, RankPool, Send

__all__ = ["QUARANTINE_S", "WorkerTransfers"]

log = logging.getLogger("kvxfer_client.vllm")

#: How long blocks a failed pull may still be written into are kept from vLLM.
QUARANTINE_S = 30.0


@dataclass
class _Loading:
    request_id: str
    block_ids: tuple[int, ...]
    future: concurrent.futures.Future[PullResult]
    held_until: float = 0.0  # may_still_write: not handed back before this time


class WorkerTransfers:
    def __init__(self, socket_path: str, engine_name: str, tp_rank: int, lease_s: float, pull_timeout_s: float) -> None:
        self.tp_rank = tp_rank
        self.lease_s = lease_s
        self.pull_timeout_s = pull_timeout_s
        self.client = KvxferClient(socket_path, engine_name=engine_name)
        self.pool: Pool | None = None
        self._loading: dict[str, _Loading] = {}
        self._released: dict[str, concurrent.futures.Future[OfferReleased]] = {}
        self.load_errors: set[int] = set()
        #: Counters for vLLM's connector stats (a snapshot is taken and reset each interval).
        self.stats = {"pulls": 0, "pull_failures": 0, "pulled_bytes": 0, "pull_seconds": 0.0, "offers": 0}

    def register(self, kv_caches: Mapping[str, Any], num_blocks: int, model: ModelInfo) -> RankPool:
        """Register the rank's KV tensors (one buffer per layer, in vLLM's layer order)."""
        tensors = list(kv_caches.values())
        layout = layout_from_tensors(tensors, block_dim=_block_dim(tensors[0], num_blocks), model=model)
        self.pool = self.client.register_pool(tensors, layout, name=f"vllm-tp{self.tp_rank}")
        log.info(
            "kvxfer: registered %d KV tensors of TP rank %d as pool %s (%d blocks, %d regions, %d bytes per block)",
            len(tensors),
            self.tp_rank,
            self.pool.pool_id,
            layout.num_blocks,
            len(layout.regions),
            layout.bytes_per_block,
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

    def start(self, loads: list[Load], sends: list[Send]) -> None:
        """Watch this step's offers (the scheduler made them) and start its pulls; returns at once."""
        assert self.pool is not None, "register_kv_caches first"
        for send in sends:
            ticket = Ticket.from_dict(send.tickets[self.tp_rank])
            self._released[send.request_id] = self.client.watch_release(ticket.offer_id)
            self.stats["offers"] += 1
        for load in loads:
            if len(load.tickets) <= self.tp_rank:
                raise KvxferError(
                    f"request {load.request_id}: the prefill engine sent {len(load.tickets)} tickets, this is TP rank "
                    f"{self.tp_rank} (prefill and decode need the same tensor-parallel size)"
                )
            future = self.client.start_pull(
                Ticket.from_dict(load.tickets[self.tp_rank]),
                self.pool,
                load.block_ids,
                timeout_s=self.pull_timeout_s,
                offer_block_indices=load.offer_block_indices,
            )
            self._loading[load.request_id] = _Loading(load.request_id, load.block_ids, future)

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished sending, finished receiving, failed receiving)`` since the last poll;
        failed loads' blocks go to :attr:`load_errors`."""
        sending = {rid for rid, f in self._released.items() if f.done()}
        for rid in sending:
            del self._released[rid]
        receiving: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        for rid, loading in list(self._loading.items()):
            if not loading.future.done() or now < loading.held_until:
                continue
            error = loading.future.exception()
            if isinstance(error, KvxferError) and error.may_still_write and not loading.held_until:
                loading.held_until = now + QUARANTINE_S
                log.warning("kvxfer: pull for %s failed and may still be written; blocks held %.0fs", rid, QUARANTINE_S)
                continue
            del self._loading[rid]
            receiving.add(rid)
            self.stats["pulls"] += 1
            if error is not None:
                failed.add(rid)
                self.load_errors.update(loading.block_ids)
                self.stats["pull_failures"] += 1
                log.warning("kvxfer: pull for request %s failed: %s", rid, error)
            else:
                result = loading.future.result()
                self.stats["pulled_bytes"] += result.bytes
                self.stats["pull_seconds"] += result.duration_s
        return sending, receiving, failed

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def close(self) -> None:
        self.client.close()


def _block_dim(tensor: Any, num_blocks: int) -> int:
    """Which dimension of a KV tensor counts blocks: the first of the first two whose size is
    ``num_blocks`` (``[num_blocks, ...]`` or ``[2, num_blocks, ...]``)."""
    shape = tensor_geometry(tensor)[0]
    for dim in (0, 1):
        if dim < len(shape) and shape[dim] == num_blocks:
            return dim
    raise KvxferError(f"cannot find the block dimension ({num_blocks} blocks) in a KV tensor of shape {shape}")
