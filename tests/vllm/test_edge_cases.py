"""vLLM's own P/D edge cases, with both engines ``kv_both`` as vLLM's NIXL integration tests
run them, text in and text out (the model has a tokenizer): a prompt shorter than one block;
a prompt the decode engine holds whole in its prefix cache but the prefill engine does not;
a prompt whose first blocks only the decode engine holds. Each answer is the answer of an
engine alone, and the decode engine pulls only the blocks it lacks.

Served engines (``vllm serve``, each in its own session) on two daemons; the flow is the toy
proxy's (the prefill engine with ``do_remote_decode`` and one token, then the decode engine
with what it answered).
"""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from bench.cluster import ROOT, Cluster, Daemon
from bench.vllm_engine import BLOCK_SIZE, MODEL_CONFIG, write_model
from bench.vllm_served import PREFILL_PARAMS, ServedEngine, vllm_python

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
SERVE_ARGS: dict[str, Any] = {
    "args": ["--max-model-len", "1024", "--block-size", str(BLOCK_SIZE), "--dtype", "bfloat16"],
    "tokenizer": True,
}


def _words(first: int, count: int) -> str:
    """A prompt of ``count`` tokens (the test tokenizer: one word per token id)."""
    return " ".join(f"w{i}" for i in range(first, first + count))


SHORT = _words(10, 5)  # under one block
PROMPT = _words(100, 2 * BLOCK_SIZE + 6)  # two whole blocks and a part
LONG = PROMPT + " " + _words(300, 2 * BLOCK_SIZE)  # PROMPT's blocks, then more
#: One block of the test model's KV: keys and values of each layer's heads, in bfloat16.
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * int(str(MODEL_CONFIG["num_hidden_layers"]))
BLOCK_BYTES *= int(str(MODEL_CONFIG["num_key_value_heads"])) * int(str(MODEL_CONFIG["head_dim"]))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedEngine, ServedEngine, Daemon]]:
    """The prefill engine, the decode engine, and the decode engine's daemon."""
    work = tmp_path_factory.mktemp("edge")
    model = write_model(str(work / "model"))
    subprocess.run([vllm_python(), "-m", "bench.vllm_tokenizer", model], cwd=ROOT, check=True)
    with Cluster() as cluster:
        a, b = cluster.daemon("a"), cluster.daemon("b")
        prefill = ServedEngine("kv_both", a.socket, model, str(work / "prefill.log"), **SERVE_ARGS)
        decode = ServedEngine("kv_both", b.socket, model, str(work / "decode.log"), **SERVE_ARGS)
        try:
            prefill.wait()
            decode.wait()
            yield prefill, decode, b
        finally:
            prefill.close()
            decode.close()


def _text(engine: ServedEngine, prompt: str, params: dict[str, Any] | None = None, max_tokens: int = MAX_TOKENS) -> Any:
    """One completion, alone (``params`` None) or as half of a handoff: ``(text, kv params)``."""
    body: dict[str, Any] = {"model": engine.model_dir, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    status, answer = engine.post(body, str(uuid.uuid4()))
    assert status == 200, answer
    return answer["choices"][0]["text"], answer.get("kv_transfer_params") or {}


def _handoff(prefill: ServedEngine, decode: ServedEngine, decode_daemon: Daemon, prompt: str) -> tuple[str, int]:
    """The toy proxy's two calls: ``(the decode engine's text, bytes its daemon pulled)``."""
    _, params = _text(prefill, prompt, dict(PREFILL_PARAMS), max_tokens=1)
    assert params.get("kvxfer_tickets"), params  # handed off, not refused
    text, _ = _text(decode, prompt, params)
    offers = {t["offer_id"] for t in params["kvxfer_tickets"]}
    pulled = [
        int(m.group(1))
        for line in decode_daemon.log().splitlines()
        if "transfer.done" in line and "role=decode" in line and any(f"offer_id={o} " in line for o in offers)
        for m in [re.search(r" bytes=(\d+)", line)]
        if m
    ]
    return text, sum(pulled)


def test_a_prompt_shorter_than_a_block(pair: tuple[ServedEngine, ServedEngine, Daemon]) -> None:
    prefill, decode, b = pair
    alone, _ = _text(prefill, SHORT)
    handed, pulled = _handoff(prefill, decode, b, SHORT)
    assert handed == alone and alone, (handed, alone)
    assert pulled == BLOCK_BYTES, pulled  # its one block moved


def test_a_whole_prefix_cache_hit_on_the_decode_engine_only(pair: tuple[ServedEngine, ServedEngine, Daemon]) -> None:
    """The decode engine served PROMPT itself before; the prefill engine never saw it. The
    decode engine pulls only the part block its cache cannot hold and answers as it did alone."""
    prefill, decode, b = pair
    alone, _ = _text(decode, PROMPT)
    handed, pulled = _handoff(prefill, decode, b, PROMPT)
    assert handed == alone, (handed, alone)
    assert pulled == BLOCK_BYTES, pulled  # the part block, not the two it holds


def test_a_partial_prefix_cache_hit_on_the_decode_engine(pair: tuple[ServedEngine, ServedEngine, Daemon]) -> None:
    """LONG starts with PROMPT's two blocks, which the decode engine holds (the test above):
    it pulls the other three and answers as the prefill engine does alone."""
    prefill, decode, b = pair
    _text(decode, PROMPT)  # PROMPT's blocks in the decode engine's cache, whatever ran before
    handed, pulled = _handoff(prefill, decode, b, LONG)
    alone, _ = _text(prefill, LONG)
    assert handed == alone, (handed, alone)
    assert pulled == 3 * BLOCK_BYTES, pulled  # five blocks, two of them held
