"""The quick start (docs/quickstart.md) as a user runs it: two daemons, then the prefill
engine's ticket piped into the decode engine, which checks every byte it pulled."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def test_the_quick_start_hands_blocks_from_one_engine_to_the_other() -> None:
    with Cluster() as cluster:
        a, b = cluster.daemon("quick-a"), cluster.daemon("quick-b")
        prefill = subprocess.Popen(
            [sys.executable, str(QUICKSTART), "prefill", "--socket", a.socket],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        decode = subprocess.run(
            [sys.executable, str(QUICKSTART), "decode", "--socket", b.socket],
            stdin=prefill.stdout,
            capture_output=True,
            text=True,
            timeout=120,
        )
        _, prefill_err = prefill.communicate(timeout=60)
    assert decode.returncode == 0, decode.stderr
    assert "pulled 1048576 bytes" in decode.stdout and "every byte checked" in decode.stdout
    assert prefill.returncode == 0 and b"blocks released (pulled)" in prefill_err, prefill_err
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    assert "python examples/quickstart.py prefill --socket /tmp/kvx-a.sock" in quickstart
