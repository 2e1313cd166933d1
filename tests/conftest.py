"""Shared fixtures: real daemons and engine processes on loopback."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.cluster import Cluster  # noqa: E402

# The daemons here share one host but stand for daemons on different hosts: their pulls go over
# UCX, as between hosts. Tests of same-host direct reads turn those on for their own daemons.
os.environ.setdefault("KVXFERD_SAME_HOST_DIRECT_READ", "false")


def _has_gpu() -> bool:
    try:
        import cupy  # type: ignore[import-not-found]

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def two_daemons() -> Iterator[Cluster]:
    """Daemons ``a`` and ``b`` (``cluster.daemons[0]`` and ``[1]``), shared by a module."""
    with Cluster() as cluster:
        cluster.daemon("a")
        cluster.daemon("b")
        yield cluster


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """An empty cluster for tests that start (and stop) their own daemons."""
    with Cluster() as c:
        yield c
