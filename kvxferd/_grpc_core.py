"""The gRPC core settings the daemon runs with, chosen before gRPC is first imported.

gRPC's core reads ``GRPC_EXPERIMENTS`` once, when it is loaded. Its newer I/O layer (the
EventEngine client and listener) hands each message of a grpc.aio stream between more threads
than its older poller does; with it off, one message on an open stream between two processes
here costs about a third less (a round trip over TCP: 470-510 µs against 290-320 µs, a write
110 against 160 µs of CPU; docs/benchmarks.md, "gRPC's core"). Every control message of a
handoff pays that, so the daemon turns it off unless its environment already says otherwise
(``GRPC_EXPERIMENTS`` set, even empty, is left as it is).

``kvxferd/__init__.py`` calls :func:`choose` before anything imports gRPC; the daemon logs
the choice at start (``daemon.grpc_core``).

>>> env = {}
>>> choose(env, grpc_loaded=False), env
('default', {'GRPC_EXPERIMENTS': '-event_engine_client,-event_engine_listener'})
>>> choose({"GRPC_EXPERIMENTS": ""}, grpc_loaded=False)
'environment'
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["EXPERIMENTS", "choice", "choose"]

#: The experiments the daemon turns off (a leading "-" turns one off).
EXPERIMENTS = "-event_engine_client,-event_engine_listener"

_chosen = "not chosen"


def choose(env: MutableMapping[str, str] | None = None, grpc_loaded: bool | None = None) -> str:
    """Set ``GRPC_EXPERIMENTS`` in ``env`` (this process's environment) unless it is set or
    gRPC is already loaded. Returns where the setting comes from: "default" (set here),
    "environment" (the operator's), or "too late" (gRPC was loaded first: its own)."""
    global _chosen
    env = os.environ if env is None else env
    loaded = "grpc" in sys.modules if grpc_loaded is None else grpc_loaded
    if "GRPC_EXPERIMENTS" in env:
        _chosen = "environment"
    elif loaded:
        _chosen = "too late"
    else:
        env["GRPC_EXPERIMENTS"] = EXPERIMENTS
        _chosen = "default"
    return _chosen


def choice() -> tuple[str, str]:
    """What this process runs with (``GRPC_EXPERIMENTS``) and where it came from, for the
    start-up log."""
    return os.environ.get("GRPC_EXPERIMENTS", ""), _chosen
