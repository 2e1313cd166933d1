"""`make demo` end to end (slow: it moves 2.5 GiB)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.cluster import ROOT, _env


@pytest.mark.slow
def test_demo_verifies_every_byte_on_both_paths() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.demo"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["path"] for r in rows} == {"local", "remote"}
    assert all(r["verified"] is True and r["gbps"] > 0 for r in rows)
