"""Print a metrics exposition of kvxferd with every family populated, for
``promtool check metrics`` in ``make lint`` (a live daemon's is checked in tests/unit/test_deploy.py)."""

from __future__ import annotations

import sys

from kvxferd._metrics import Metrics
from kvxferd._snapshot import NodeSnapshot, StagingView
from kvxferd._transfers import EndedTransfer


def main() -> None:
    snap = NodeSnapshot(daemon_id="sample", draining=False, staging={"send": StagingView(1, 2, 8, 1 << 20)})
    m = Metrics(lambda: snap)
    m.transfer_finished(EndedTransfer("decode", "remote", "ucx:tcp", "succeeded", "none", 1 << 20, 0.01))
    m.transfer_finished(EndedTransfer("prefill", "remote", "none", "refused", "refused", 0, 0.001))
    m.rpc_finished("pull", "OK", 0.01)
    m.offer_released("expired")
    sys.stdout.buffer.write(m.render())


if __name__ == "__main__":
    main()
