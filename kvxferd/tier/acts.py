"""The node's KV tier as engines and peers ask for it: stores, lookups and loads in the node's
own tier (or the error that says how to turn it on), offers of its chunks, and other nodes'
tiers read over the data plane. Each act checks the caller's pool through the node's
admission guard first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvxfer.errors import InvalidRequestError, UnavailableError
from kvxfer.ticket import Ticket

from .._admission import Admission
from .._asks import PullAsk
from .._config import Settings
from .._offers import Offer, OfferTable
from .._transfers import TransferRecord
from ..memory.block_ids import check_block_ids
from ..peer.directory import PeerDirectory
from .host import HostTier
from .offers import TierOffers
from .remote import TierPeers

__all__ = ["KvTier", "TierAsk"]


@dataclass(frozen=True)
class TierAsk:
    """An engine's ask of a tier: its session and pool (with the pool's offer key when the pool
    is another session's of the engine), the keys of the blocks, and the engine's salt."""

    session_id: str
    pool_id: str
    keys: list[bytes]
    salt: bytes
    offer_key: bytes = b""


class _Node(Protocol):
    """What the tier's acts need of the node."""

    settings: Settings
    daemon_id: str
    admission: Admission
    tier: HostTier | None
    offers: OfferTable
    peers: PeerDirectory
    remote: Any

    async def pull(self, ask: PullAsk) -> TransferRecord: ...


class KvTier:
    def __init__(self, node: _Node, publish: Callable[[Offer, int], Ticket]) -> None:
        self.node = node
        #: Offers of the tier's chunks; other nodes reading this node's tier, and this node theirs.
        self.offers = TierOffers(self.host, node.offers, publish)
        self.peers = TierPeers(node.daemon_id, self.host, self.offers, node.settings.peer_timeout_s)

    def host(self) -> HostTier:
        """The tier, or the error that says how to turn it on."""
        if self.node.tier is None:
            raise UnavailableError("the node's KV tier is off: give it memory with tier_host_bytes")
        return self.node.tier

    async def store(self, ask: TierAsk, block_ids: Sequence[int]) -> tuple[int, int]:
        """Store the pool's blocks under the keys; returns (stored, skipped: held already)."""
        tier, pool = self.host(), self.node.admission.owned_pool(ask.pool_id, ask.session_id)
        ids = check_block_ids(block_ids, pool.layout.num_blocks, "tier store")
        return await tier.store(pool, ids, ask.keys, ask.salt)

    def lookup(self, ask: TierAsk) -> int:
        """How many of the keys, from the first, the node's tier holds in the pool's namespace."""
        tier, pool = self.host(), self.node.admission.keyed_pool(ask.pool_id, ask.session_id, ask.offer_key)
        return tier.lookup(pool, ask.keys, ask.salt)

    async def load(self, ask: TierAsk, block_ids: Sequence[int]) -> int:
        """Copy the stored prefix of the keys into the blocks; returns its length."""
        tier, pool = self.host(), self.node.admission.owned_pool(ask.pool_id, ask.session_id)
        ids = check_block_ids(block_ids, pool.layout.num_blocks, "tier load")
        return await tier.load(pool, ids, ask.keys, ask.salt)

    async def offer(
        self, ask: TierAsk, lease_s: float, readers: int = 1, prefix: bool = False
    ) -> tuple[Offer | None, Ticket | None]:
        """Offer chunks of the node's KV tier (stored under the keys, or with ``prefix`` the
        longest stored prefix of them, in the pool's namespace): pinned in the tier until the
        offer ends, pulled like any offer; the engine's own blocks are not held (it may reuse
        them once they are stored). ``(None, None)``: a prefix of nothing."""
        self.node.admission.admit("offers")
        pool = self.node.admission.keyed_pool(ask.pool_id, ask.session_id, ask.offer_key)
        offer, ticket = await self.offers.offer(pool, ask.keys, ask.salt, lease_s, readers, prefix)
        if offer is not None:
            offer.owner = ask.session_id  # it hears of the release (set before anything awaits)
        return offer, ticket

    async def from_peer(
        self, ask: TierAsk, address: str, block_ids: Sequence[int] | None = None, timeout_s: float = 0.0
    ) -> int:
        """Another node's tier (:mod:`.remote`): the stored prefix of the keys there, and given
        ``block_ids``, that prefix pulled into them; returns its length."""
        node, s = self.node, self.node.settings
        pool = node.admission.owned_pool(ask.pool_id, ask.session_id)
        if node.remote is None:
            raise UnavailableError("another node's tier is read over the data plane: UCX is not loaded here")
        ids = check_block_ids(block_ids, pool.layout.num_blocks, "tier load") if block_ids is not None else None
        if ids is not None and len(ids) != len(ask.keys):
            raise InvalidRequestError(f"{len(ask.keys)} keys for {len(ids)} blocks: one key per block")
        peer = await node.peers.dial(address)
        hits, ticket = await self.peers.ask(peer, address, pool, ask.keys, ask.salt, offer=ids is not None)
        if ticket is not None and ids is not None:
            timeout = timeout_s or s.pull_timeout_s
            await node.pull(PullAsk(ask.session_id, ask.pool_id, ticket, ids[:hits].tolist(), timeout))
        return hits
