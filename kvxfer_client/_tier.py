"""The node's KV tier, as an engine calls it (:class:`TierCalls`, part of the clients).

Blocks are stored under the engine's own keys, one per block: a chained hash of the block's
tokens and its predecessor's key, so equal keys mean equal prefixes. The daemon keeps them in
its memory, in a layout independent of the engine's tensor parallelism, for every engine of
the node (also after the storing engine exits), within ``tier_host_bytes``.

>>> def chained(tokens, block_tokens=16, seed=b"model-a"):
...     import hashlib
...     keys, prev = [], seed
...     for i in range(0, len(tokens) - len(tokens) % block_tokens, block_tokens):
...         prev = hashlib.sha256(prev + repr(tokens[i : i + block_tokens]).encode()).digest()
...         keys.append(prev)
...     return keys
>>> len(chained(list(range(40))))   # two full blocks; the partial one is not stored
2
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvxfer.proto import engine_pb2
from kvxfer.ticket import Ticket

from ._results import Pool, PoolRef, pool_target

__all__ = ["TierCalls"]


class _Client(Protocol):
    @property
    def session_id(self) -> str: ...
    @property
    def _engine(self) -> Any: ...
    async def _call(self, method: Any, request: Any, timeout_s: float | None = None) -> Any: ...
    async def _ready(self) -> None: ...


class TierCalls:
    """Store, look up and load blocks of the node's KV tier (mixed into the clients)."""

    async def tier_store(
        self: _Client, pool: Pool | str, block_ids: Sequence[int], keys: Sequence[bytes], *, salt: bytes = b""
    ) -> tuple[int, int]:
        """Copy blocks into the tier under ``keys`` (one per block); returns (stored, skipped:
        already stored or no room). The blocks may be reused once this returns."""
        await self._ready()  # connected (or back after a restart), as every call
        req = engine_pb2.TierStoreRequest(
            session_id=self.session_id,
            pool_id=pool.pool_id if isinstance(pool, Pool) else pool,
            block_ids=list(block_ids),
            keys=list(keys),
            salt=salt,
        )
        resp = await self._call(self._engine.TierStore, req)
        return int(resp.stored), int(resp.skipped)

    async def tier_offer(
        self: _Client,
        pool: Pool | PoolRef | str,
        keys: Sequence[bytes],
        *,
        salt: bytes = b"",
        lease_s: float = 0.0,
        readers: int = 1,
        prefix: bool = False,
    ) -> Ticket | None:
        """Offer the chunks stored under ``keys`` (all of them stored; with ``prefix``, the
        longest stored prefix of them: None when nothing is) as one ticket, pulled like any
        other; the pool's blocks are not held by it (store them first, then reuse them at
        once). ``lease_s`` 0: the daemon's default lease. ``pool``: as for ``offer``."""
        await self._ready()
        pool_id, offer_key = pool_target(pool)
        req = engine_pb2.TierOfferRequest(
            session_id=self.session_id,
            pool_id=pool_id,
            keys=list(keys),
            salt=salt,
            lease_s=lease_s,
            readers=readers,
            prefix=prefix,
            offer_key=offer_key,
        )
        resp = await self._call(self._engine.TierOffer, req)
        return Ticket.from_proto(resp.ticket) if resp.HasField("ticket") else None

    async def tier_lookup(
        self: _Client,
        pool: Pool | PoolRef | str,
        keys: Sequence[bytes],
        *,
        salt: bytes = b"",
        from_peer: str = "",
    ) -> int:
        """How many of ``keys``, from the first, the tier holds for this pool's namespace
        (``from_peer``: another node's kvxferd, ``host:port``, whose tier to ask; ``pool``: as
        for ``offer``)."""
        await self._ready()
        pool_id, offer_key = pool_target(pool)
        req = engine_pb2.TierLookupRequest(
            session_id=self.session_id,
            pool_id=pool_id,
            keys=list(keys),
            salt=salt,
            from_peer=from_peer,
            offer_key=offer_key,
        )
        return int((await self._call(self._engine.TierLookup, req)).hits)

    async def tier_load(
        self: _Client,
        pool: Pool | str,
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        *,
        salt: bytes = b"",
        from_peer: str = "",
        timeout_s: float = 0.0,
    ) -> int:
        """Copy the longest stored prefix of ``keys`` into ``block_ids`` (``block_ids[j]`` takes
        ``keys[j]``); returns how many blocks were loaded: compute the rest. ``from_peer``:
        load from another node's tier (``host:port`` of its kvxferd), over the data plane,
        within ``timeout_s`` (0: the daemon's pull timeout)."""
        await self._ready()
        req = engine_pb2.TierLoadRequest(
            session_id=self.session_id,
            pool_id=pool.pool_id if isinstance(pool, Pool) else pool,
            block_ids=list(block_ids),
            keys=list(keys),
            salt=salt,
            from_peer=from_peer,
            timeout_s=timeout_s,
        )
        timeout = (timeout_s or 60.0) + 5.0 if from_peer else None
        return int((await self._call(self._engine.TierLoad, req, timeout)).loaded)
