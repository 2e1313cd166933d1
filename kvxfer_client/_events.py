"""Events a daemon streams to an engine session."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvxfer.proto import common_pb2, engine_pb2

__all__ = ["LayersLanded", "OfferReleased", "ReleaseReason", "TransferFailed", "event_from_proto"]


class ReleaseReason(StrEnum):
    """Why an offer's blocks were handed back to the prefill engine."""

    PULLED = "pulled"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    FAILED = "failed"
    POOL_GONE = "pool_gone"
    SHUTDOWN = "shutdown"
    UNKNOWN = "unknown"

    @classmethod
    def from_proto(cls, value: common_pb2.ReleaseReason.ValueType) -> ReleaseReason:
        return _REASONS.get(value, cls.UNKNOWN)


_REASONS: dict[common_pb2.ReleaseReason.ValueType, ReleaseReason] = {
    common_pb2.RELEASE_REASON_PULLED: ReleaseReason.PULLED,
    common_pb2.RELEASE_REASON_EXPIRED: ReleaseReason.EXPIRED,
    common_pb2.RELEASE_REASON_CANCELLED: ReleaseReason.CANCELLED,
    common_pb2.RELEASE_REASON_FAILED: ReleaseReason.FAILED,
    common_pb2.RELEASE_REASON_POOL_GONE: ReleaseReason.POOL_GONE,
    common_pb2.RELEASE_REASON_SHUTDOWN: ReleaseReason.SHUTDOWN,
}


@dataclass(frozen=True)
class OfferReleased:
    """The daemon no longer holds the offer: the engine may free (or reuse) its blocks."""

    offer_id: str
    pool_id: str
    reason: ReleaseReason
    detail: str = ""
    transfer_id: str = ""


@dataclass(frozen=True)
class TransferFailed:
    """A transfer of this session failed after its Pull call returned (rare)."""

    transfer_id: str
    detail: str


@dataclass(frozen=True)
class LayersLanded:
    """The first ``layers`` layers of a layer-wise transfer into this session's pool landed
    (see :meth:`AsyncKvxferClient.wait_layers`)."""

    transfer_id: str
    layers: int


def event_from_proto(msg: engine_pb2.EngineEvent) -> OfferReleased | TransferFailed | LayersLanded | None:
    kind = msg.WhichOneof("event")
    if kind == "offer_released":
        r = msg.offer_released
        return OfferReleased(r.offer_id, r.pool_id, ReleaseReason.from_proto(r.reason), r.detail, r.transfer_id)
    if kind == "transfer_failed":
        return TransferFailed(msg.transfer_failed.transfer_id, msg.transfer_failed.detail)
    if kind == "layers_landed":
        return LayersLanded(msg.layers_landed.transfer_id, int(msg.layers_landed.layers))
    return None
