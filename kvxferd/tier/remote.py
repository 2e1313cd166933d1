"""Another node's tier, one hop away: lookups and loads over the peer protocol and data plane.

The calling daemon sends its pool's layout signature, the keys and the salt
(``PeerService.TierOffer``); the owning daemon derives the namespace from them exactly as for
its own engines, counts the stored prefix and, for a load, offers those chunks for one pull
(pinned until it ends). The caller then pulls the ticket like any other, into its engine's
blocks: UCX, TCP lanes or a direct read, integrity checks included. Which node holds which
prefix is only the caller's hint: the owner answers from its own index, never creates a
namespace for a peer, and serves chunks read-only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvxfer.errors import IncompatibleError, InvalidRequestError
from kvxfer.geometry import KvGeometry
from kvxfer.layout import MAX_BLOCKS, MAX_REGIONS, Layout, ModelInfo, Region
from kvxfer.proto import common_pb2, peer_pb2
from kvxfer.ticket import Ticket

from ..memory.pools import Pool
from ..peer.directory import Peer
from .host import HostTier
from .offers import TierOffers

__all__ = ["TierPeers", "peer_layout"]

#: Largest block one region of a peer's described pool may have.
MAX_REGION_BYTES = 1 << 30


def peer_layout(sig: common_pb2.LayoutSignature) -> Layout:
    """A peer's pool as its signature describes it, checked (a typed refusal, never a crash)."""
    sizes = list(sig.block_bytes)
    if not 1 <= len(sizes) <= MAX_REGIONS or not all(0 < n <= MAX_REGION_BYTES for n in sizes):
        raise InvalidRequestError("a tier request's pool signature has no regions, too many, or absurd sizes")
    model = ModelInfo.from_proto(sig.model)
    if not 1 <= model.tp_size <= 4096 or not 0 <= model.tp_rank < model.tp_size:
        raise InvalidRequestError("a tier request's pool signature has an impossible TP size or rank")
    geometry = KvGeometry.from_proto(sig.geometry)
    if geometry is not None:
        for n in set(sizes):
            geometry.check(model.tp_size, model.tp_rank, n)
    return Layout(1, tuple(Region(0, 0, n, n) for n in sizes), model, geometry)


class TierPeers:
    def __init__(self, daemon_id: str, tier: Callable[[], HostTier], offers: TierOffers, timeout_s: float) -> None:
        self.daemon_id = daemon_id
        self._tier = tier
        self.offers = offers
        #: How long the calling side waits for an answer.
        self.timeout_s = timeout_s
        #: How long another node's read holds the chunks it was offered.
        self.lease_s = 4 * timeout_s

    async def serve(self, request: peer_pb2.PeerTierOfferRequest) -> peer_pb2.PeerTierOfferResponse:
        """The owning side: count (and, asked to, offer) the stored prefix of the keys."""
        if len(request.keys) > MAX_BLOCKS:
            raise InvalidRequestError(f"more than {MAX_BLOCKS} keys")
        tier, layout = self._tier(), peer_layout(request.signature)
        keys, salt = list(request.keys), bytes(request.salt)
        hits = tier.lookup(layout, keys, salt)
        if not request.offer or not hits:
            return peer_pb2.PeerTierOfferResponse(hits=hits)
        offer, ticket = await self.offers.offer(layout, keys[:hits], salt, self.lease_s, prefix=True)
        if offer is None or ticket is None:  # evicted since it was counted
            return peer_pb2.PeerTierOfferResponse(hits=0)
        return peer_pb2.PeerTierOfferResponse(hits=len(offer.block_ids), ticket=ticket.to_proto())

    async def ask(
        self, peer: Peer, address: str, pool: Pool, keys: list[bytes], salt: bytes, offer: bool
    ) -> tuple[int, Ticket | None]:
        """The calling side: the stored prefix at ``peer`` and, with ``offer``, its ticket
        (checked: it names that daemon, and is pulled from the address dialled)."""
        req = peer_pb2.PeerTierOfferRequest(
            daemon_id=self.daemon_id, signature=pool.layout.signature(), keys=keys, salt=salt, offer=offer
        )
        resp = await peer.tier_offer(req, self.timeout_s)
        hits = int(resp.hits)
        if hits > len(keys):
            raise IncompatibleError(f"peer {peer.daemon_id} says {hits} of {len(keys)} keys are stored")
        if not offer or not hits:
            return hits, None
        ticket = Ticket.from_proto(resp.ticket)
        if ticket.daemon_id != peer.daemon_id or ticket.num_blocks != hits:
            raise IncompatibleError(f"peer {peer.daemon_id} offered its tier's chunks under another ticket")
        return hits, dataclasses.replace(ticket, peer_address=address)
