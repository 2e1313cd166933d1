"""Fleet tests: real etcd servers (Debian's etcd-server, which make test installs) and real
daemons registered in them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.etcd import EtcdCluster, etcd_missing


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    missing = etcd_missing()
    if missing:  # make test installs it: a missing server is a broken setup, not a skip
        pytest.fail(missing)
    with EtcdCluster(1) as server:
        yield server
