"""The documentation tells the truth about the code: the reference pages are exactly what the
code generates (settings, command lines, metrics), every page is in the site's navigation, and
the README stays a front door (the site holds the rest). ``make docs`` builds the site strictly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_pages_are_what_the_code_generates(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_docs.py"), str(tmp_path)], check=True, capture_output=True
    )
    for fresh in sorted(tmp_path.glob("*.md")):
        committed = ROOT / "docs" / "reference" / fresh.name
        assert committed.exists(), f"{fresh.name} missing: run `make docs-reference`"
        assert committed.read_text() == fresh.read_text(), (
            f"docs/reference/{fresh.name} is stale: run `make docs-reference`"
        )


def _nav_pages(entries: list[object]) -> set[str]:
    pages: set[str] = set()
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages |= _nav_pages(value) if isinstance(value, list) else {str(value)}
    return pages


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == _nav_pages(config["nav"])


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
