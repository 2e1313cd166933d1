"""The fleet: this daemon's record in the cluster's etcd registry, kept alive by its lease,
and the records of every other daemon, watched (see ``docs/fleet.md``).

==================  =====================================================================
``registry``        :class:`Registry`: register (create-if-absent), keep the lease, re-put
                    a lost record, deregister on drain; its state for the CLI and metrics
``members``         :class:`Members`: the other daemons' records as the watch left them,
                    and which daemons left (lease expired or drained)
``view``            :class:`RegistryView`, the registry's state as readers see it
``record``          this daemon's :class:`~kvxfer.fleet.FleetRecord`, built from its settings
==================  =====================================================================

The registry is optional and only ever a hint: without it (or with etcd unreachable) every
handoff goes by the address in its ticket, as it always did.
"""

from .registry import Registry, RegistryConflictError
from .view import RegistryView

__all__ = ["Registry", "RegistryConflictError", "RegistryView"]
