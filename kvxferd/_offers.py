"""Offers: blocks pinned for a decode engine, with a lease and a capability token."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer_client._errors import IncompatibleError, NotFoundError, PermissionDeniedError, ResourceExhaustedError

from .memory.pools import Pool

__all__ = ["Offer", "OfferTable"]

OFFERED = "offered"
PULLING = "pulling"


@dataclass
class Offer:
    offer_id: str
    pool: Pool
    block_ids: npt.NDArray[np.int64]
    token: bytes
    deadline: float
    nbytes: int
    state: str = OFFERED
    timer: asyncio.TimerHandle | None = None


class OfferTable:
    """Live offers by id. ``on_expire`` is called (on the loop) when a lease ends unpulled."""

    def __init__(self, max_offers: int, on_expire: Callable[[Offer], None]) -> None:
        self.max_offers = max_offers
        self.offers: dict[str, Offer] = {}
        self._on_expire = on_expire

    def create(self, pool: Pool, block_ids: npt.NDArray[np.int64], lease_s: float) -> Offer:
        if len(self.offers) >= self.max_offers:
            raise ResourceExhaustedError(f"this daemon holds its maximum of {self.max_offers} offers")
        offer = Offer(
            offer_id="off-" + secrets.token_hex(8),
            pool=pool,
            block_ids=block_ids,
            token=secrets.token_bytes(16),
            deadline=time.time() + lease_s,
            nbytes=len(block_ids) * pool.layout.bytes_per_block,
        )
        self._arm(offer)
        self.offers[offer.offer_id] = offer
        pool.offers.add(offer.offer_id)
        return offer

    def _arm(self, offer: Offer) -> None:
        if offer.timer is not None:
            offer.timer.cancel()
        delay = max(0.0, offer.deadline - time.time())
        offer.timer = asyncio.get_running_loop().call_later(delay, self._expire, offer.offer_id)

    def extend(self, offer_id: str, token: bytes, lease_s: float) -> float:
        """Push the lease end to ``lease_s`` from now (never earlier); returns seconds left."""
        offer = self._checked(offer_id, token)
        offer.deadline = max(offer.deadline, time.time() + lease_s)
        self._arm(offer)
        return offer.deadline - time.time()

    def _checked(self, offer_id: str, token: bytes) -> Offer:
        offer = self.offers.get(offer_id)
        if offer is None:
            raise NotFoundError(
                f"no offer {offer_id!r} (never made, already pulled, released, expired, or its daemon restarted)"
            )
        if not hmac.compare_digest(offer.token, token):
            raise PermissionDeniedError(f"wrong token for offer {offer_id!r}")
        return offer

    def _expire(self, offer_id: str) -> None:
        offer = self.offers.get(offer_id)
        if offer is not None and offer.state == OFFERED:
            self._on_expire(offer)

    def claim(self, offer_id: str, token: bytes) -> Offer:
        """Check the token and mark the offer as being pulled (one pull at a time)."""
        offer = self._checked(offer_id, token)
        if offer.state != OFFERED:
            raise IncompatibleError(f"offer {offer_id!r} is already being pulled")
        offer.state = PULLING
        return offer

    def unclaim(self, offer: Offer) -> None:
        """A pull was refused before any byte moved: the offer is pullable again (and expires
        at once if its lease ended meanwhile)."""
        if offer.offer_id in self.offers:
            offer.state = OFFERED
            self._arm(offer)

    def remove(self, offer_id: str) -> Offer | None:
        offer = self.offers.pop(offer_id, None)
        if offer is not None:
            if offer.timer is not None:
                offer.timer.cancel()
            offer.pool.offers.discard(offer_id)
        return offer
