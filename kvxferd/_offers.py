"""Offers: blocks pinned for a decode engine, with a lease and a capability token.

Every way an offer ends goes through :meth:`OfferTable.release` with a reason (pulled, failed,
expired, cancelled, pool gone, shutdown): it is logged, counted, and handed to the table's
release sink once (the daemon tells the owning engine).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import (
    AlreadyExistsError,
    IncompatibleError,
    InvalidRequestError,
    NotFoundError,
    OfferExpiredError,
    OfferTakenError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from kvxfer.proto import common_pb2

from ._log import log_event
from ._sessions import check_owner
from .memory.block_ids import check_block_ids
from .memory.pools import Pool

__all__ = ["Offer", "OfferTable", "ReleaseSink"]

OFFERED = "offered"
PULLING = "pulling"
#: Ended offers remembered with their reason (about 100 bytes each).
ENDED_MEMORY = 100_000
DAEMON_OFFER_PREFIX = "off-"
#: Offer ids that pulls may wait for at once (each waiting pull holds one until its offer
#: comes or ``wait_s`` passes).
MAX_AWAITED = 4096
_ENDED = {
    "expired": "expired: its lease ended before anyone pulled it (extend_lease keeps a waiting offer alive)",
    "pulled": "was already pulled by another transfer (an offer is pulled once per reader)",
    "cancelled": "was released or cancelled before anyone pulled it",
    "failed": "ended with a failed pull (the prefill engine may offer the blocks again)",
    "pool_gone": "ended with its pool (deregistered, or its engine went away)",
    "shutdown": "ended when its daemon shut down",
}
_REASON_NAMES: dict[int, str] = {
    v: k.removeprefix("RELEASE_REASON_").lower() for k, v in common_pb2.ReleaseReason.items()
}


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
    #: Pulls this offer serves before it is released as pulled; how many landed, how many run.
    readers: int = 1
    pulled: int = 0
    pulling: int = 0
    #: Set for an offer pushed to a decode daemon (engine.proto, Push): where and under which
    #: transfer id, shown as the transfer's mode reason.
    pushed_to: str = ""
    #: Layer-wise offers (OfferRequest.layers): how many layers the engine writes, and how many
    #: it has said are written. 0 layers: written before the offer.
    layers: int = 0
    ready_layers: int = 0
    #: Its blocks' checksums once written (:mod:`._integrity`, a ``Digest``), or why
    #: none are taken.
    digest: asyncio.Future[Any] | None = field(default=None, repr=False)
    integrity_off: str = ""
    #: The engine session the offer belongs to, when it is not its pool's (an offer of chunks
    #: of the node's KV tier, :mod:`.tier`); it hears of the release.
    owner: str = ""
    #: Called once when the offer ends, whatever the reason (the tier unpins its chunks).
    on_end: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def session_id(self) -> str:
        """The session that owns the offer."""
        return self.owner or self.pool.session_id

    _advanced: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def written(self) -> bool:
        return self.ready_layers >= self.layers

    def mark_ready(self, layers: int) -> None:
        """The engine wrote the first ``layers`` layers (more than it said before, or nothing)."""
        if layers > self.ready_layers and self.layers:
            self.ready_layers = min(layers, self.layers)
            advanced, self._advanced = self._advanced, asyncio.Event()
            advanced.set()

    async def wait_ready(self, layers: int) -> int:
        """Wait until at least ``layers`` layers are written (all of them when fewer exist);
        returns how many are."""
        while self.ready_layers < min(layers, self.layers):
            await self._advanced.wait()
        return self.ready_layers if self.layers else 0

    def blocks_at(self, indices: npt.NDArray[np.int64] | None) -> npt.NDArray[np.int64]:
        """The blocks a pull moves: all of the offer's (``indices`` None), or those at these
        positions of its block list (checked: in range, no repeats)."""
        if indices is None:
            return self.block_ids
        return self.block_ids[check_block_ids(indices, len(self.block_ids), "offer_block_indices")]


#: Called once per released offer: ``(offer, reason, detail, transfer_id)``.
ReleaseSink = Callable[["Offer", "common_pb2.ReleaseReason.ValueType", str, str], None]


class OfferTable:
    """Live offers by id; ``on_release`` hears of each one that ends, whatever the reason."""

    def __init__(
        self,
        max_offers: int,
        on_release: ReleaseSink,
        count: Callable[[str], None] = lambda reason: None,
        wait_s: float = 0.0,
    ) -> None:
        self.max_offers = max_offers
        #: How long a pull waits for an offer not made yet (:meth:`claim_soon`).
        self.wait_s = wait_s
        #: Pulls waiting for an offer id not made yet: the event the offer sets, and how many wait.
        self._awaited: dict[str, tuple[asyncio.Event, int]] = {}
        self.offers: dict[str, Offer] = {}
        self._on_release = on_release
        self._count = count  # by reason name (the metrics)
        #: Recently ended offers, why, and their token: a late pull with the right token hears
        #: "expired" rather than "no offer" (without it, nothing about the offer is told).
        self._ended: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        #: Offers whose lease ended before any pull.
        self.expiries = 0

    def create(
        self,
        pool: Pool,
        block_ids: npt.NDArray[np.int64],
        lease_s: float,
        chosen: tuple[str, bytes] | None = None,
        readers: int = 1,
        layers: int = 0,
    ) -> Offer:
        """A new offer; ``chosen``: the id and token the engine picked in advance (checked for
        form by the control plane), else fresh ones; ``readers``: pulls it serves; ``layers``:
        written layer by layer (0: written already)."""
        regions = len(pool.layout.regions)
        if layers and (layers > regions or regions % layers):
            raise InvalidRequestError(f"{layers} layers do not divide the pool's {regions} regions into equal groups")
        if len(self.offers) >= self.max_offers:
            raise ResourceExhaustedError(f"this daemon holds its maximum of {self.max_offers} offers")
        offer_id, token = chosen or (DAEMON_OFFER_PREFIX + secrets.token_hex(8), secrets.token_bytes(16))
        if offer_id in self.offers or offer_id in self._ended:
            raise AlreadyExistsError(f"offer id {offer_id!r} is taken (choose a fresh random one per offer)")
        offer = Offer(
            offer_id=offer_id,
            pool=pool,
            block_ids=block_ids,
            token=token,
            deadline=time.time() + lease_s,
            nbytes=len(block_ids) * pool.layout.bytes_per_block,
            readers=readers,
            layers=layers,
        )
        self._arm(offer)
        self.offers[offer.offer_id] = offer
        pool.offers.add(offer.offer_id)
        awaited = self._awaited.pop(offer_id, None)
        if awaited is not None:
            awaited[0].set()
        return offer

    def ended(self, offer_id: str) -> bool:
        """Whether ``offer_id`` was an offer of this daemon that has ended (recently)."""
        return offer_id in self._ended

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
            reason, ended_token = self._ended.get(offer_id, ("", b""))
            if reason and hmac.compare_digest(ended_token, token):
                error = {"expired": OfferExpiredError, "pulled": OfferTakenError}.get(reason, NotFoundError)
                raise error(f"offer {offer_id!r} {_ENDED.get(reason, 'ended: ' + reason)}", offer_id=offer_id)
            raise NotFoundError(
                f"no offer {offer_id!r} (never made, already pulled, released, expired, or its daemon restarted)"
            )
        if not hmac.compare_digest(offer.token, token):
            raise PermissionDeniedError(f"wrong token for offer {offer_id!r}")
        return offer

    def _expire(self, offer_id: str) -> None:
        offer = self.offers.get(offer_id)
        if offer is not None and offer.state == OFFERED:
            self.expiries += 1
            detail = "lease ended before any pull"
            if offer.pulled:
                detail = f"lease ended with {offer.pulled} of its {offer.readers} readers pulled"
            self.release(offer, common_pb2.RELEASE_REASON_EXPIRED, detail)

    async def claim_soon(self, offer_id: str, token: bytes) -> Offer:
        """:meth:`claim`, waiting up to ``wait_s`` for an offer that was never made yet: its
        ticket may have gone out first (the engine chose the id in advance). An offer that
        ended, or a wait past ``wait_s``, is refused as by :meth:`claim`."""
        made_here = len(offer_id) == len(DAEMON_OFFER_PREFIX) + 16  # this daemon's own ids: never "not yet"
        if offer_id not in self.offers and offer_id not in self._ended and self.wait_s > 0 and not made_here:
            if offer_id not in self._awaited and len(self._awaited) >= MAX_AWAITED:
                raise ResourceExhaustedError(f"{MAX_AWAITED} pulls already wait for offers not made yet")
            event, waiting = self._awaited.get(offer_id, (asyncio.Event(), 0))
            self._awaited[offer_id] = (event, waiting + 1)
            log_event("offer.awaited", offer_id=offer_id, wait_s=self.wait_s)
            try:
                async with asyncio.timeout(self.wait_s):
                    await event.wait()
            except TimeoutError:
                pass
            finally:
                # The last waiter to give up forgets the id; the offer's creation pops it.
                current = self._awaited.get(offer_id)
                if current is not None and current[0] is event:
                    if current[1] <= 1:
                        del self._awaited[offer_id]
                    else:
                        self._awaited[offer_id] = (event, current[1] - 1)
        return self.claim(offer_id, token)

    def claim(self, offer_id: str, token: bytes) -> Offer:
        """Check the token and mark the offer as being pulled (as many pulls at once as it
        has readers left)."""
        offer = self._checked(offer_id, token)
        if offer.pulled + offer.pulling >= offer.readers:
            raise OfferTakenError(
                f"offer {offer_id!r} is already being pulled by another transfer"
                + (f" (all of its {offer.readers} readers are taken)" if offer.readers > 1 else ""),
                offer_id=offer_id,
            )
        offer.pulling += 1
        offer.state = PULLING
        return offer

    def unclaim(self, offer: Offer) -> None:
        """A pull was refused before any byte moved: the offer is pullable again (and expires
        at once if its lease ended meanwhile)."""
        offer.pulling = max(0, offer.pulling - 1)
        if offer.offer_id in self.offers and offer.pulling == 0:
            offer.state = OFFERED
            self._arm(offer)

    def pulled(self, offer: Offer, transfer_id: str, readers: int = 1) -> None:
        """A pull of ``offer`` landed, for ``readers`` of its readers (a puller's daemon may
        have handed the bytes on: see TransferDone.readers): released as pulled once every
        reader has its bytes; until then the others may come (within the lease)."""
        offer.pulling = max(0, offer.pulling - 1)
        offer.pulled += max(1, readers)  # more than it has left: the offer is done all the same
        if offer.pulled >= offer.readers:
            self.release(offer, common_pb2.RELEASE_REASON_PULLED, "", transfer_id)
            return
        log_event(
            "offer.read", offer_id=offer.offer_id, transfer_id=transfer_id, pulled=offer.pulled, readers=offer.readers
        )
        if offer.pulling == 0:
            offer.state = OFFERED
            self._arm(offer)

    def release(
        self, offer: Offer, reason: common_pb2.ReleaseReason.ValueType, detail: str = "", transfer_id: str = ""
    ) -> None:
        """End ``offer`` (nothing when it has ended already) and tell the release sink."""
        if self.offers.pop(offer.offer_id, None) is None:
            return
        if offer.timer is not None:
            offer.timer.cancel()
        offer.pool.offers.discard(offer.offer_id)
        if offer.on_end is not None:
            offer.on_end()
        name = _REASON_NAMES.get(reason, "unknown")
        self._ended[offer.offer_id] = (name, offer.token)
        if len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        self._count(name)
        # A pulled offer is the transfer's own line (transfer.done); any other end is news.
        log_event(
            "offer.release",
            logging.DEBUG if reason == common_pb2.RELEASE_REASON_PULLED else logging.INFO,
            offer_id=offer.offer_id,
            reason=name,
            transfer_id=transfer_id or "-",
            detail=detail or "-",
        )
        self._on_release(offer, reason, detail, transfer_id)

    def release_unpulled(
        self, offer_id: str, reason: common_pb2.ReleaseReason.ValueType, detail: str, owner: str | None = None
    ) -> Offer:
        """Release an offer nobody is pulling (an engine's or an operator's act). ``owner``:
        the caller's session, which must own the offer's pool (None: an operator)."""
        offer = self.offers.get(offer_id)
        if offer is None:
            raise NotFoundError(f"no offer {offer_id!r}")
        if owner is not None:
            check_owner(offer.session_id, owner, f"offer {offer_id!r}")
        if offer.state != OFFERED:
            raise IncompatibleError(f"offer {offer_id!r} is being pulled; cancel the transfer instead")
        self.release(offer, reason, detail)
        return offer

    def release_all(self, reason: common_pb2.ReleaseReason.ValueType, detail: str, pool_id: str | None = None) -> int:
        """Release every offer (of ``pool_id`` only, when given); returns how many."""
        ended = [o for o in self.offers.values() if pool_id is None or o.pool.pool_id == pool_id]
        for offer in ended:
            self.release(offer, reason, detail)
        return len(ended)
