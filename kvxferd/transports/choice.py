"""The one place a remote transfer picks its transport, on each side: the decode daemon from
what the offering daemon accepted, the offering daemon from what the puller asked for and
what the offer is."""

from __future__ import annotations

from typing import Any

from kvxfer.errors import IncompatibleError
from kvxfer.proto import peer_pb2

from .._services import Services
from ..dataplane.gpu_kernel import BlockSide
from ..dataplane.plan import SidePlan, build_plan, stream_plan
from .direct import DirectRead, Lend
from .direct_proof import source_of
from .faces import Asked, Landing, Receiver, Sender, Sending
from .lanes import LaneReceive, LaneSend
from .plane import RemotePlane
from .ucx_tags import UcxReceive, UcxSend

__all__ = ["choose_receiver", "choose_sender", "sums_of"]


def choose_receiver(
    landing: Landing,
    services: Services,
    plane: RemotePlane,
    accepted: peer_pb2.TransferAccepted,
    asked: Asked,
    endpoint: Any,
) -> Receiver:
    """The one place a pull picks how its bytes land, from the offering daemon's answer."""
    direct = accepted.HasField("direct")
    if accepted.HasField("lanes"):
        if not asked.lanes or accepted.layers or direct:
            raise IncompatibleError(f"peer {landing.peer.daemon_id} answered with TCP lanes this pull cannot take")
        return LaneReceive(landing, services, plane, accepted.lanes, asked.lanes)
    if direct:
        return DirectRead(landing, services, accepted.direct, asked.nonce, accepted.sender_signature)
    return UcxReceive(landing, services, plane, endpoint, asked.tag_base)


def choose_sender(sending: Sending, services: Services, plane: RemotePlane, remapped: SidePlan | None) -> Sender:
    """The one place the offering side picks how the bytes move (and cuts them: chunk size,
    plan, layers), from the puller's start and the offer."""
    t, settings = sending, services.settings
    pool, start = t.offer.pool, t.start
    # The receiver's maximum, capped by what this side stages per chunk.
    t.chunk = min(start.chunk_bytes, settings.gpu_chunk_bytes if pool.on_gpu else settings.chunk_bytes)
    if remapped is not None:
        t.plan = remapped  # planned at the chunk size this side picks (host pools only)
    elif pool.device is not None:
        t.side = BlockSide.of(pool.device, pool.base, pool.regions, t.src_ids)
        t.plan = stream_plan(t.side.total_bytes, t.chunk)
    elif not plane.ucx.gather_send or pool.process is not None:
        t.plan = build_plan(pool.regions, t.src_ids, t.chunk)  # staging depends on it
    # A layer-wise offer (still being written) moves per layer where its blocks move as they
    # are, from host memory; otherwise whole, once written.
    t.layers = t.offer.layers if remapped is None and t.side is None else 0
    t.per_layer = t.layers > 1 and t.record.nbytes >= settings.layerwise_min_bytes
    nonce = start.direct_read_nonce
    lent = (
        source_of(pool, t.src_ids, nonce)
        if nonce and settings.same_host_direct_read and (t.layers or t.offer.written)
        else None
    )
    if lent is not None:
        return Lend(t, services, plane, lent)
    if start.tcp_lanes and plane.lanes is not None and t.side is None and not t.per_layer:
        return LaneSend(t, services, plane)
    if not t.per_layer:
        t.layers = 0  # told to the puller only where the bytes move per layer
    return UcxSend(t, services, plane)


def sums_of(said: Any) -> peer_pb2.BlockSums | None:
    """The block sums the offering daemon's ``sent`` carries, if any."""
    return said.sums if isinstance(said, peer_pb2.TransferSent) and said.HasField("sums") else None
