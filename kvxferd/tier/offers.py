"""Offers of the tier's chunks: one act for an engine's ``TierOffer`` and another node's read.

The chunks stored under the keys (every one, or the longest stored prefix) are pinned in the
tier and offered like a pool's blocks: the offer's pool is the namespace's slots, its blocks
the chunks' slots, so every path that pulls an offer (a local copy, UCX, TCP lanes, a direct
read; a remap to another TP) pulls these too, integrity checks included. The pins go when the
offer ends, whatever ends it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvxfer.layout import Layout
from kvxfer.ticket import Ticket

from .._offers import Offer, OfferTable
from ..memory.pools import Pool
from .host import HostTier

__all__ = ["TierOffers"]


class TierOffers:
    def __init__(
        self, tier: Callable[[], HostTier], offers: OfferTable, publish: Callable[[Offer, int], Ticket]
    ) -> None:
        self._tier = tier
        self.offers = offers
        #: Takes the new offer's digest and makes its ticket (``readers`` pulls).
        self._publish = publish

    async def offer(
        self,
        pool: Pool | Layout,
        keys: list[bytes],
        salt: bytes,
        lease_s: float,
        readers: int = 1,
        prefix: bool = False,
    ) -> tuple[Offer | None, Ticket | None]:
        """Offer the chunks stored under ``keys`` in ``pool``'s namespace (``prefix``: the
        longest stored prefix of them; ``(None, None)`` when that is nothing). Nobody hears of
        its release until the caller names the offer's ``owner`` (an engine's session)."""
        view, slots, unpin = await self._tier().hold(pool, keys, salt, prefix)
        if view is None:
            return None, None
        try:
            offer = self.offers.create(view, slots, lease_s, None, readers)
        except BaseException:
            unpin()
            raise
        offer.on_end = unpin
        return offer, self._publish(offer, readers)
