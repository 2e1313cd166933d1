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
the writes, so the blocks are never reused while a late write can land in them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._blocking import KvxferClient
from .._errors import IncompatibleError, InvalidRequestError, KvxferError
from .._geometry import KvGeometry, head_sources, rank_heads
from .._layout import ModelInfo
from .._results import Pool, PullResult, PushResult
from .._tensor_layout import layout_from_tensors, tensor_geometry
from .._ticket import Ticket
from ._plan import Load, RankPool, Send, Stream, stream_id
from ._tier import TierLoad, TierSave

__all__ = [
    "QUARANTINE_S",
    "SENTINEL_BLOCKS",
    "HeadFacts",
    "WorkerTransfers",
    "block_dim_of",
    "kv_format_of",
    "kv_geometry",
]

log = logging.getLogger("vllm.kvxfer")

#: How long blocks a failed pull may still be written into are kept from vLLM.
QUARANTINE_S = 30.0
#: How long the end of a step waits for a push's answer (one round trip, started with the step).
PUSH_ANSWER_S = 30.0


@dataclass
class _Loading:
    request_id: str
    block_ids: tuple[int, ...]
    #: One pull per prefill rank this rank takes heads from (one when the TP sizes match).
    futures: list[concurrent.futures.Future[PullResult]]
    held_until: float = 0.0  # may_still_write: not handed back before this time
    #: From the node's KV tier (a stored prefix), not from a prefill engine.
    tier: bool = False


@dataclass
class _Pushing:
    """A push this step makes, and how many of its layers were said written."""

    request_id: str
    push: concurrent.futures.Future[PushResult]
    marked: int = 0

    def ready(self) -> PushResult | None:
        """Its answer once it came and was a push (layers may be marked), else None."""
        if not self.push.done() or self.push.exception() is not None:
            return None
        result = self.push.result()
        return result if result.mode == "push" else None


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
        self._released: dict[str, concurrent.futures.Future[Any]] = {}

        self.load_errors: set[int] = set()
        #: Pool layers (one per KV tensor), by vLLM's layer name.
        self.layers = 0
        self._layer_of: dict[str, int] = {}
        self._pushing: list[_Pushing] = []
        #: On a GPU, marks wait for the layer's kernels on this thread (None: CPU tensors,
        #: written when the layer returns).
        self._marker: concurrent.futures.ThreadPoolExecutor | None = None
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
        tensors = list(kv_caches.values())
        self._layer_of = {name: index for index, name in enumerate(kv_caches)}
        self.layers = len(tensors)
        if getattr(tensors[0], "is_cuda", False):
            self._marker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvxfer-layer-marks")
        block_dim = block_dim_of(tensors[0], num_blocks, backend_shape)
        layout = layout_from_tensors(tensors, block_dim=block_dim, model=model)
        geometry = kv_geometry(tensors[0], block_dim, layout, heads, model) if heads is not None else None
        if geometry is not None:
            layout = dataclasses.replace(layout, geometry=geometry)
        kv_format = kv_format_of(tensors[0], block_dim, geometry, backend)
        layout = dataclasses.replace(layout, model=dataclasses.replace(layout.model, kv_format=kv_format))
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
        and its pushes (their layers marked by :meth:`layer_saved`), and cancel the receives
        of requests that ended; returns at once."""
        assert self.pool is not None, "register_kv_caches first"
        for transfer_id in cancels:
            self.client.start_cancel(stream_id(transfer_id, self.tp_rank)).add_done_callback(_log_refusal)
        for stream in streams:
            push = self.client.start_push(
                self.pool,
                stream.block_ids,
                stream_id(stream.transfer_id, self.tp_rank),
                stream.to_peer_address,
                lease_s=self.lease_s,
                layers=self.layers,
            )
            self._pushing.append(_Pushing(stream.request_id, push))
            self._count("pushes")
        for send in sends:
            if send.readers and not send.readers[self.tp_rank]:
                self._released[send.request_id] = _done()  # nobody reads this rank's heads: no offer
                continue
            ticket = Ticket.from_dict(send.tickets[self.tp_rank])
            self._released[send.request_id] = self.client.watch_release(ticket.offer_id)
            self._count("offers")
        for load in loads:
            try:
                if load.refused:
                    raise InvalidRequestError(load.refused)
                # Streamed: rank to rank, this rank's push (see ``stream_id``).
                sources = self.sources(len(load.tickets)) if not load.transfer_id else [self.tp_rank]
            except KvxferError as error:
                # Refused here, reported as a failed load (vLLM's policy then applies): an
                # exception out of a step would stop the engine.
                error.args = (f"request {load.request_id}: {error}",)
                self._loading[load.request_id] = _Loading(load.request_id, load.block_ids, [_failed(error)])
                continue
            if load.transfer_id:  # streamed: this rank's push, whichever comes first
                receive = self.client.start_receive(
                    stream_id(load.transfer_id, self.tp_rank),
                    self.pool,
                    load.block_ids,
                    timeout_s=self.pull_timeout_s,
                    offer_block_indices=load.offer_block_indices,
                )
                self._loading[load.request_id] = _Loading(load.request_id, load.block_ids, [receive])
                continue
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
            self._loading[load.request_id] = _Loading(load.request_id, load.block_ids, futures)

    def start_tier(self, loads: list[TierLoad], saves: list[TierSave], salt: bytes) -> None:
        """Store finished requests' blocks into the node's KV tier (each is reported finished
        sending once stored, or once the store failed: the cache only misses it) and load
        stored prefixes; returns at once."""
        assert self.pool is not None, "register_kv_caches first"
        for save in saves:
            self._released[save.request_id] = self.client.start_tier_store(
                self.pool, save.block_ids, save.keys, salt=salt
            )
            self._count("tier_saves")
        for load in loads:  # the tier's offer of a stored prefix: pulled like a prefill's
            ticket = Ticket.from_dict(load.ticket)
            indices = tuple(range(len(load.block_ids))) if len(load.block_ids) < ticket.num_blocks else None
            pull = self.client.start_pull(
                ticket, self.pool, load.block_ids, timeout_s=self.pull_timeout_s, offer_block_indices=indices
            )
            self._loading[load.request_id] = _Loading(load.request_id, load.block_ids, [pull], tier=True)

    def layer_saved(self, layer_name: str) -> None:
        """vLLM left an attention layer (``save_kv_layer``): this step's pushes may send it
        and every layer before it. Returns at once."""
        index = self._layer_of.get(layer_name)
        if self._pushing and index is not None:
            self._mark(list(self._pushing), index + 1)

    def step_saved(self) -> None:
        """The forward pass is over (``wait_for_save``): every layer of this step's pushes is
        written. Waits only for the pushes' answers (started with the step); the blocks stay
        with vLLM until each push is released (finished sending)."""
        pushing, self._pushing = self._pushing, []
        for p in pushing:
            try:
                result = p.push.result(PUSH_ANSWER_S)
            except (KvxferError, concurrent.futures.TimeoutError) as exc:
                log.error("kvxfer: request %s was not pushed: %s (its decode side gets nothing)", p.request_id, exc)
                self._released[p.request_id] = _done()
                continue
            self._released[p.request_id] = self.client.watch_release(result.ticket.offer_id)
            if result.mode != "push":
                # The decode daemon could not take it: nobody will pull this ticket here.
                log.error("kvxfer: request %s was not pushed (%s); withdrawing it", p.request_id, result.mode_reason)
                try:
                    self.client.release(result.ticket.offer_id)
                except KvxferError as exc:  # e.g. already expired: its release event follows
                    log.warning("kvxfer: could not withdraw request %s's offer: %s", p.request_id, exc)
        self._mark(pushing, self.layers)

    def _mark(self, pushing: list[_Pushing], layers: int) -> None:
        """Say ``layers`` layers of these pushes written: at once on CPU tensors (written when
        the layer returned), after the GPU work queued so far on a GPU (a CUDA event)."""
        if self._marker is None:
            self._send_marks(pushing, layers)
            return
        import torch  # only reached with CUDA tensors registered

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        self._marker.submit(_after(event.synchronize, self._send_marks, pushing, layers))

    def _send_marks(self, pushing: list[_Pushing], layers: int) -> None:
        offers = []
        for p in pushing:
            result = p.ready()
            if result is not None and layers > p.marked:
                p.marked = layers
                offers.append(result.ticket.offer_id)
        if offers:
            self.client.start_layers_ready(offers, layers).add_done_callback(_log_refusal)

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
        sending = {rid for rid, f in self._released.items() if f.done()}
        for rid in sending:
            future = self._released.pop(rid)
            if future.exception() is not None:  # a store that failed: nothing is lost but the cache
                log.warning("kvxfer: %s for request %s failed: %s", "tier store", rid, future.exception())
        receiving: set[str] = set()
        failed: set[str] = set()

        now = time.monotonic()
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
                log.warning("kvxfer: pull for request %s failed: %s", rid, error)
            else:
                results = [f.result() for f in loading.futures]
                self._count("pulled_bytes", sum(r.bytes for r in results))
                self._count("pull_seconds", max(r.duration_s for r in results))
                if loading.tier:
                    self._count("tier_loaded_blocks", len(loading.block_ids))
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
        if self._marker is not None:
            self._marker.shutdown(wait=True)
        self.client.close()


@dataclass(frozen=True)
class HeadFacts:
    """What vLLM's KV cache spec and model config say of one rank's heads."""

    block_size: int
    #: This rank's KV heads, and the model's before the tensor-parallel split.
    heads: int
    total_heads: int


def kv_geometry(tensor: Any, block_dim: int, layout: Any, facts: HeadFacts, model: ModelInfo) -> KvGeometry | None:
    """The geometry of vLLM's KV tensors, or None when it cannot be read unambiguously (the
    pool then only meets pools of the same TP and layout).

    Every region must be ``block_size x heads`` pieces of the same size (one head of one token:
    K and V together for the CPU backend's packed content, one of them for split planes); the
    head order is read off the strides of the heads and tokens dimensions.

    >>> import numpy as np
    >>> from kvxfer_client import layout_from_tensors
    >>> cpu = np.zeros((8, 2, 16, 256), dtype=np.uint16)  # [blocks, heads, tokens, 2 * head]
    >>> m = ModelInfo("m", "bf16", 16, tp_size=2, tp_rank=1)
    >>> kv_geometry(cpu, 0, layout_from_tensors([cpu], block_dim=0), HeadFacts(16, 2, 4), m)
    KvGeometry(block_tokens=16, total_kv_heads=4, head_bytes=512, order='HND')
    """
    if rank_heads(facts.total_heads, max(1, model.tp_size), model.tp_rank).count != facts.heads:
        return None
    sizes = {r.block_bytes for r in layout.regions}
    piece = facts.block_size * facts.heads
    if len(sizes) != 1 or next(iter(sizes)) % piece:
        return None
    head_bytes = next(iter(sizes)) // piece
    shape, strides, _ = tensor_geometry(tensor)
    dims = list(range(block_dim + 1, len(shape)))  # inside a block (outer dims are regions: K/V)
    head_dims = [d for d in dims if shape[d] == facts.heads]
    token_dims = [d for d in dims if shape[d] == facts.block_size]
    order = "HND"
    if facts.heads > 1:
        pairs = [(h, t) for h in head_dims for t in token_dims if h != t]
        if len(pairs) != 1:
            return None  # e.g. as many heads as tokens per block: the sizes cannot tell
        h, t = pairs[0]
        order = "HND" if strides[h] > strides[t] else "NHD"
    return KvGeometry(facts.block_size, facts.total_heads, head_bytes, order)  # type: ignore[arg-type]


def kv_format_of(tensor: Any, block_dim: int, geometry: KvGeometry | None, backend: str) -> str:
    """The pool's KV format (common.proto, ModelInfo.kv_format): what the fingerprint must
    hold of the in-block layout beyond the sizes. Without a geometry, the whole shape (blocks
    as ``B``) and the attention backend: engines whose kernels lay blocks out differently never
    meet. With one, only what no mapping bridges: how K and V share a region (a mapping handles
    TP, head order and block size, and the geometry holds the bytes per head).

    >>> import numpy as np
    >>> cpu = np.zeros((8, 2, 16, 256), dtype=np.uint16)       # [blocks, heads, tokens, K|V]
    >>> kv_format_of(cpu, 0, None, "CPU_ATTN")
    'vllm/CPU_ATTN [B,2,16,256] x2'
    >>> g = KvGeometry(16, 4, 512, "HND")
    >>> kv_format_of(cpu, 0, g, "CPU_ATTN"), kv_format_of(np.zeros((2, 8, 16, 2, 128)), 1, g, "FLASH")
    ('vllm kv=packed', 'vllm kv=planes')
    """
    shape, _, itemsize = tensor_geometry(tensor)
    if geometry is not None:
        return f"vllm kv={'planes' if block_dim else 'packed'}"
    dims = ["B" if d == block_dim else str(n) for d, n in enumerate(shape)]
    name = f"vllm/{backend}" if backend else "vllm"
    return f"{name} [{','.join(dims)}] x{itemsize}"


def _done() -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(None)
    return future


def _failed(error: BaseException) -> concurrent.futures.Future[PullResult]:
    future: concurrent.futures.Future[PullResult] = concurrent.futures.Future()
    future.set_exception(error)
    return future


def _zero_stats() -> dict[str, Any]:
    return {
        "pulls": 0,
        "pull_failures": 0,
        "pulled_bytes": 0,
        "pull_seconds": 0.0,
        "offers": 0,
        "pushes": 0,
        "tier_saves": 0,
        "tier_loaded_blocks": 0,
    }


def _after(wait: Callable[[], Any], then: Callable[..., None], *args: Any) -> Callable[[], None]:
    def run() -> None:
        wait()
        then(*args)

    return run


def _log_refusal(future: concurrent.futures.Future[Any]) -> None:
    """A layer mark or cancel the daemon refused: the push then ends by its lease or its
    receiver's deadline (logged here so the reason is not lost)."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("kvxfer: the daemon refused a layer mark or cancel: %s", future.exception())


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
