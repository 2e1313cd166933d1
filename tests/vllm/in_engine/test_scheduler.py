"""vLLM's real scheduler driving the connector against a real daemon: the prefill side keeps a
request's blocks until its offer is pulled, the decode side waits for the pull, and the bytes
move. The model runner is replaced by this test (it reports what a worker would), the
connector's worker side is the real one, registering numpy "KV caches" with the daemon.

Run inside the vLLM venv (``make vllm-test`` does): it imports vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from bench.cluster import Cluster
from bench.vllm_engine import write_model
from kvxfer_client._layout import ModelInfo
from kvxfer_client.vllm._connector import KvxferHandshake
from kvxfer_client.vllm._worker import WorkerTransfers

BLOCK = 32
NUM_BLOCKS = 64
HEADS, HEAD = 1, 128  # one layer of [num_blocks, heads, block, 2 * head] (the CPU backend's shape)


def _config(model: str, role: str, socket_path: str) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvxferConnector",
            kv_connector_module_path="kvxfer_client.vllm",
            kv_role=role,
            kv_connector_extra_config={"socket": socket_path, "lease_s": 30},
        ),
        device_config=DeviceConfig("cpu"),
    )


class Engine:
    """vLLM's scheduler plus the connector's real worker side over numpy KV caches."""

    def __init__(self, model: str, role: str, socket_path: str) -> None:
        config = _config(model, role, socket_path)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)]
        )
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        self.kv = np.zeros((NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD), dtype=np.uint16)  # bf16 bits
        self.worker = WorkerTransfers(socket_path, f"test-{role}", tp_rank=0, lease_s=30, pull_timeout_s=30)
        pool = self.worker.register({"layer0": self.kv}, NUM_BLOCKS, ModelInfo("tiny", "bf16", BLOCK, 1, 0))
        self.scheduler.connector.set_xfer_handshake_metadata({0: KvxferHandshake(pool)})

    def step(self, token: int = 7) -> Any:
        """One engine step: schedule, let the worker side act on the metadata, report back."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        if meta is not None:
            self.worker.start(meta.loads, meta.sends)
        sending, receiving, failed = self.worker.poll()
        req_ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[token] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=receiving or None,
                failed_recving=failed,
                invalid_block_ids=self.worker.take_load_errors(),
            ),
        )
        return self.scheduler.update_from_output(out, runner)

    def close(self) -> None:
        self.scheduler.connector.shutdown()
        self.worker.close()


init_none_hash(sha256)  # vLLM's prefix-cache hashing, once per process


def _request(rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.update_from_generation_config({}, 2)
    req = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    req.kv_transfer_params = params
    return req


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    model = write_model(str(tmp_path_factory.mktemp("model")))
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
    params = _params_of(prefill.step(), "p1")
    assert params and params["do_remote_prefill"] and len(params["kvxfer_tickets"]) == 1
    free_while_held = prefill.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert "p1" in prefill.scheduler.requests, "blocks must stay held (delay_free) until the pull"
    src = list(prefill.scheduler.kv_cache_manager.get_block_ids("p1")[0])
    assert params["kvxfer_tickets"][0]["num_blocks"] == len(src) == 4
    # What the prefill worker "computed": recognisable bytes in every block.
    prefill.kv[:] = np.random.default_rng(5).integers(0, 1 << 16, prefill.kv.shape, dtype=np.uint16)

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


def _run_until(engine: Engine, done: Any, what: str, limit_s: float = 20.0) -> Any:
    deadline = time.monotonic() + limit_s
    outputs = None
    while not done():
        assert time.monotonic() < deadline, what
        outputs = engine.step()
        time.sleep(0.01)
    return outputs


def test_a_prefix_cache_hit_pulls_only_the_blocks_the_decode_engine_lacks(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    shared = list(range(500, 500 + 2 * BLOCK))  # two full blocks both requests start with
    # The decode engine computed the shared prefix for an earlier request (its prefix cache).
    decode.scheduler.add_request(_request("d-warm", [*shared, 1, 2, 3], 1, None))
    _run_until(decode, lambda: "d-warm" not in decode.scheduler.requests, "the warm-up request never finished")
    prompt = shared + list(range(900, 900 + BLOCK + 7))  # 4 blocks, 2 of them cached on decode
    prefill.scheduler.add_request(_request("p2", prompt, 1, {"do_remote_decode": True}))
    params = _params_of(prefill.step(), "p2")
    assert params is not None
    src = list(prefill.scheduler.kv_cache_manager.get_block_ids("p2")[0])
    prefill.kv[:] = np.random.default_rng(6).integers(0, 1 << 16, prefill.kv.shape, dtype=np.uint16)
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
    outputs = _run_until(decode, lambda: "d3" not in decode.scheduler.requests, "the failed load hung the request")
    finished = [o for eo in (outputs or {}).values() for o in eo.outputs if o.request_id == "d3"]
    assert finished and finished[0].finish_reason is not None  # vLLM's "fail" policy: an error, not a hang
    assert decode.worker.stats["pull_failures"] >= 1


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
    model = write_model(str(tmp_path_factory.mktemp("model-dead")))
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
            outputs = _run_until(decode, lambda: "d5" not in decode.scheduler.requests, "the load hung", 40)
            finished = [o for eo in (outputs or {}).values() for o in eo.outputs if o.request_id == "d5"]
            assert finished and finished[0].finish_reason is not None
            assert decode.worker.stats["pull_failures"] == 1
        finally:
            prefill.close()
            decode.close()
