"""Plot a ``bench.gpu`` (or ``bench``) JSON result: GB/s per workload and path, with the
ceiling and the UCXX baseline of the same run as reference lines.

Run: ``python -m bench.plot bench-gpu.json --out bench/results/gpu.png`` (needs the
``bench`` extra: matplotlib).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def plot(rows: list[dict[str, Any]], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    handoffs = [r for r in rows if "path" in r]
    workloads = list(dict.fromkeys(r["workload"] for r in handoffs))
    paths = list(dict.fromkeys(r["path"] for r in handoffs))
    ceilings = {r["bytes"]: r["gbps_median"] for r in rows if "ceiling" in r}
    baseline = next((r for r in rows if r.get("baseline")), None)
    fig, (ax, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(paths))

    def value(w: str, path: str, key: str) -> float:
        return float(next((r.get(key) or 0.0 for r in handoffs if r["workload"] == w and r["path"] == path), 0.0))

    for i, path in enumerate(paths):
        xs = [k + i * width for k in range(len(workloads))]
        data = [value(w, path, "gbps_data_plane") for w in workloads]
        e2e = [value(w, path, "gbps") for w in workloads]
        ax.bar(xs, data, width, alpha=0.35, color=f"C{i}", label=f"{path}: data plane")
        bars = ax.bar(xs, e2e, width, color=f"C{i}", label=f"{path}: offer → done")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
        for x, v in zip(xs, data, strict=True):
            if v:
                ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7)
        device = [value(w, path, "gbps_device") for w in workloads]
        if any(device):
            dx = [x for x, v in zip(xs, device, strict=True) if v]
            ax.scatter(dx, [v for v in device if v], marker="^", color=f"C{i}", s=30, label=f"{path}: GPU time")
    kernels = {r["kernel"]: r["gbps_median"] for r in rows if "kernel" in r and not r.get("sweep")}
    kx = [k for k, w in enumerate(workloads) if w in kernels]
    if kx:
        ax.scatter(kx, [kernels[workloads[k]] for k in kx], marker="D", color="k", s=18, label="copy kernel alone")
    for k, w in enumerate(workloads):
        nbytes = next(r["request_bytes"] for r in handoffs if r["workload"] == w)
        if nbytes in ceilings:
            ax.hlines(ceilings[nbytes], k - 0.1, k + 0.9, colors="k", linestyles="--", linewidth=1)
    if baseline is not None:
        ax.axhline(baseline["gbps_median"], color="tab:red", linestyle=":", linewidth=1, label="plain UCXX send")
    ax.plot([], [], "k--", linewidth=1, label="cudaMemcpy ceiling")
    ax.set_xticks([k + width * (len(paths) - 1) / 2 for k in range(len(workloads))], workloads)
    ax.set_ylabel("payload GB/s")
    ax.set_title("throughput per handoff")
    ax.legend(fontsize=8)
    for i, path in enumerate(paths):
        p50 = [
            next((r["p50_ms"] for r in handoffs if r["workload"] == w and r["path"] == path), 0.0) for w in workloads
        ]
        p99 = [
            next((r["p99_ms"] for r in handoffs if r["workload"] == w and r["path"] == path), 0.0) for w in workloads
        ]
        xs = [k + i * width for k in range(len(workloads))]
        lat.bar(xs, p50, width, label=f"{path} p50")
        lat.scatter(xs, p99, marker="_", s=200, color="k", label="p99" if i == 0 else None)
    lat.set_xticks([k + width * (len(paths) - 1) / 2 for k in range(len(workloads))], workloads)
    lat.set_ylabel("handoff latency, ms (offer → decode done)")
    lat.set_yscale("log")
    lat.set_title("latency")
    lat.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("result")
    parser.add_argument("--out", default="bench-gpu.png")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    with open(args.result) as fh:
        rows = json.load(fh)
    device = next((r["device"] for r in rows if "device" in r), "")
    plot(rows, args.out, args.title or f"kvxfer GPU handoffs on {device or 'this machine'}")


if __name__ == "__main__":
    main()
