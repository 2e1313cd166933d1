"""The committed stubs in kvxfer/proto are exactly what proto/ generates."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_proto.py"), str(tmp_path)], check=True, capture_output=True
    )
    committed = ROOT / "kvxfer" / "proto"
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    existing = sorted(
        p.relative_to(committed) for p in committed.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh == existing, "stub files differ: run `make proto`"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, committed / p, shallow=False)]
    assert not stale, f"stale generated stubs {stale}: run `make proto`"
