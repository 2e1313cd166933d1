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
from .._errors import IncompatibleError, KvxferError
from .._events import OfferReleased
from .._layout import ModelInfo
from .._tensor_layout import layout_from_tensors, tensor_geometry
from .._ticket import Ticket
from ._plan import Load, RankPool, Send

__all__ = ["QUARANTINE_S", "SENTINEL_BLOCKS", "WorkerTransfers", "block_dim_of"]

log = logging.getLogger("vllm.kvxfer")

#: How long blocks a failed pull may still be written into are kept from vLLM.
QUARANTINE_S = 30.0


@dataclass
class _Loading:
    request_id: str
    block_ids: tuple[int, ...]
    future: concurrent.futures.Future[PullResult]
    held_until: float = 0.0  # may_still_write: not handed back before this time


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
        self.client = KvxferClient(socket_path, engine_name=engine_name)
        self.pool: Pool | None = None
        self._loading: dict[str, _Loading] = {}
        self._released: dict[str, concurrent.futures.Future[OfferReleased]] = {}
        self.load_errors: set[int] = set()
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
    ) -> RankPool:
        """Register the rank's KV tensors (one buffer per layer, in vLLM's layer order);
        ``backend_shape`` as :func:`block_dim_of` takes it."""
        tensors = list(kv_caches.values())
        layout = layout_from_tensors(
            tensors, block_dim=block_dim_of(tensors[0], num_blocks, backend_shape), model=model
        )
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
            self._count("offers")
        for load in loads:
            if len(load.tickets) != self.tp_size:
                # Refused here, reported as a failed load (vLLM's policy then applies): an
                # exception out of a step would stop the engine.
                error = IncompatibleError(
                    f"request {load.request_id}: the prefill engine has tensor-parallel size {len(load.tickets)} "
                    f"(one ticket per rank), this decode engine {self.tp_size}; they must be equal"
                )
                self._loading[load.request_id] = _Loading(load.request_id, load.block_ids, _failed(error))
                continue
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
                loading.held_until = now + self.quarantine_s
                log.warning("kvxfer: pull for %s failed, may still write; blocks held %.0fs", rid, self.quarantine_s)
                continue
            del self._loading[rid]
            receiving.add(rid)
            self._count("pulls")
            if error is not None:
                failed.add(rid)
                self.load_errors.update(loading.block_ids)
                self._count("pull_failures")
                log.warning("kvxfer: pull for request %s failed: %s", rid, error)
            else:
                result = loading.future.result()
                self._count("pulled_bytes", result.bytes)
                self._count("pull_seconds", result.duration_s)
        return sending, receiving, failed

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
        self.client.close()


def _failed(error: BaseException) -> concurrent.futures.Future[PullResult]:
    future: concurrent.futures.Future[PullResult] = concurrent.futures.Future()
    future.set_exception(error)
    return future


def _zero_stats() -> dict[str, Any]:
    return {"pulls": 0, "pull_failures": 0, "pulled_bytes": 0, "pull_seconds": 0.0, "offers": 0}


def block_dim_of(tensor: Any, num_blocks: int, backend_shape: tuple[int, ...] | None = None) -> int:
    """Which dimension of a KV tensor counts blocks.

    ``backend_shape`` is the attention backend's ``get_kv_cache_shape`` for a block count no
    other dimension has (the connector asks the backend): where that count sits is the block
    dimension. Without it, the first of the first two dimensions whose size is ``num_blocks``
    (``[num_blocks, ...]`` or ``[2, num_blocks, ...]``), refused when both are.

    >>> import numpy as np
    >>> block_dim_of(np.zeros((2, 5, 4)), 5), block_dim_of(np.zeros((5, 2, 4)), 5)
    (1, 0)
    >>> block_dim_of(np.zeros((2, 2, 4)), 2, backend_shape=(2, SENTINEL_BLOCKS, 4))
    1
    """
    shape = tensor_geometry(tensor)[0]
    if backend_shape is not None and backend_shape.count(SENTINEL_BLOCKS) == 1 and len(backend_shape) == len(shape):
        return backend_shape.index(SENTINEL_BLOCKS)
    dims = [dim for dim in (0, 1) if dim < len(shape) and shape[dim] == num_blocks]
    if len(dims) == 1:
        return dims[0]
    if not dims:
        raise KvxferError(f"cannot find the block dimension ({num_blocks} blocks) in a KV tensor of shape {shape}")
    raise KvxferError(
        f"a KV tensor of shape {shape} with {num_blocks} blocks: dimensions 0 and 1 could both count blocks, "
        "and the attention backend was not found to tell (give the engine more KV blocks)"
    )


#: A block count no KV dimension has, to find where the backend puts the blocks.
SENTINEL_BLOCKS = 7919
