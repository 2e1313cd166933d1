"""What the connector's two sides tell each other through vLLM: the scheduler's metadata for
the workers each step (:class:`KvxferMetadata`), each worker's handshake once
(:class:`KvxferHandshake`), and what workers tell the scheduler each step
(:class:`KvxferWorkerMeta`)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ._messages import Load, RankPool, Send, Stream
from ._tier import TierLoad, TierSave

__all__ = ["KvxferHandshake", "KvxferMetadata", "KvxferWorkerMeta"]


class KvxferMetadata(KVConnectorMetadata):
    """Scheduler → workers, once per step: the loads and sends to start."""

    def __init__(
        self,
        loads: list[Load],
        sends: list[Send],
        streams: list[Stream] | None = None,
        cancels: list[str] | None = None,
        tier_loads: list[TierLoad] | None = None,
        tier_saves: list[TierSave] | None = None,
    ) -> None:
        self.loads = loads
        self.sends = sends
        self.streams = streams or []
        #: Transfer ids of streamed receives whose requests ended: stop waiting for them.
        self.cancels = cancels or []
        self.tier_loads = tier_loads or []
        self.tier_saves = tier_saves or []
        #: Requests whose offer failed: vLLM already has their blocks back; stop watching them.
        self.unoffered: list[str] = []
        #: The step schedules no tokens (it only polls transfers): see :mod:`._loads`.
        self.idle = False


class KvxferHandshake(KVConnectorHandshakeMetadata):
    """Worker → scheduler, once: the rank's pool, so the scheduler can make tickets."""

    def __init__(self, pool: RankPool) -> None:
        self.pool = pool


class KvxferWorkerMeta(KVConnectorWorkerMetadata):
    """Workers → scheduler, in a step after a worker's pool was registered again (its session
    with the daemon came back): when, by rank (see ._readiness)."""

    def __init__(self, restored: dict[int, float]) -> None:
        self.restored = restored

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvxferWorkerMeta):
            return KvxferWorkerMeta({**self.restored, **other.restored})
        return self
