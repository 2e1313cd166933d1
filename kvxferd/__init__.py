"""kvxferd: the per-node daemon that moves KV-cache blocks between serving engines.

Layout of the package:

* ``control/`` — gRPC services (engine, peer, admin), listeners, the peer directory;
* ``dataplane/`` — segment plans, host copies, staging memory, the UCX transport;
* ``memory/`` — engine pools mapped into the daemon;
* ``_node`` — the daemon's state and handoff logic; ``_daemon`` — process lifecycle;
* ``_config`` — settings (defaults < YAML < ``KVXFERD_*`` < flags); ``_log`` — structured logs.

Engines never import this package; they use :mod:`kvxfer_client`.
"""

from kvxfer_client._version import __version__

from ._config import Settings, load_settings

__all__ = ["Settings", "__version__", "load_settings"]
