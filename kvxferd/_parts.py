"""Parts of the node that take some deciding to build: each logs the defaults it takes."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ._config import Settings
from ._log import log_event
from ._offers import OfferTable
from ._services import Services
from .dataplane.cma import self_copy_works
from .handoff.local import LocalHandoff
from .tier.disk import DiskStore
from .tier.host import HostTier

__all__ = ["local_handoff", "node_tier", "offer_wait_s"]


def offer_wait_s(settings: Settings) -> float:
    """How long a pull waits for an offer not made yet: a remote puller waits
    ``peer_timeout_s`` for "accepted", so the wait for the offer must fit in half of it."""
    used = min(settings.offer_wait_s, settings.peer_timeout_s / 2)
    if used < settings.offer_wait_s:
        log_event("config.offer_wait_s", used=used, asked=settings.offer_wait_s, why="half of peer_timeout_s")
    return used


def local_handoff(services: Services, offers: OfferTable) -> LocalHandoff:
    """Local copies: in one pass (``process_vm_readv`` on ourselves) where the kernel lets us."""
    settings = services.settings
    single_pass = settings.local_single_pass and self_copy_works()
    if settings.local_single_pass and not single_pass:
        log_event(
            "local_copy.two_pass",
            logging.WARNING,
            reason="process_vm_readv on this process was refused (seccomp or kernel); "
            "local host copies go through scratch",
        )
    return LocalHandoff(services, offers, single_pass)


def node_tier(
    services: Services, local: LocalHandoff, op_finished: Callable[[str, int, int, float], None]
) -> HostTier | None:
    """The node's KV tier (:mod:`.tier`), when ``tier_host_bytes`` gives it memory."""
    s = services.settings
    if not s.tier_host_bytes:
        return None
    disk = DiskStore(s.tier_disk_dir, services.executor) if s.tier_disk_dir else None
    return HostTier(services, local, op_finished, disk)
