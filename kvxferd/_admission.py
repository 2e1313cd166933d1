"""The one guard every act an engine starts passes first: whether the node takes new work, and
which pools the caller may touch.

A draining node refuses new sessions, offers and pulls (what runs already finishes). A pool is
its registering session's; another session of the same engine may offer it with the pool's
offer key (a vLLM scheduler offering its worker's blocks), never pull into it.

>>> from kvxferd.memory.pools import PoolRegistry
>>> guard = Admission(PoolRegistry())
>>> guard.admit("pulls")
>>> guard.drain()
>>> try:
...     guard.admit("pulls")
... except UnavailableError as exc:
...     print(exc)
kvxferd is draining: no new pulls
"""

from __future__ import annotations

import hmac

from kvxfer.errors import PermissionDeniedError, UnavailableError

from ._sessions import check_owner
from .memory.pools import Pool, PoolRegistry

__all__ = ["Admission"]


class Admission:
    def __init__(self, pools: PoolRegistry) -> None:
        self._pools = pools
        #: Set once by :meth:`drain`; read by the snapshot, health and the acts below.
        self.draining = False

    def drain(self) -> None:
        """From now on, refuse new work."""
        self.draining = True

    def admit(self, what: str) -> None:
        """Refuse new ``what`` (sessions, offers, pulls) once the node drains."""
        if self.draining:
            raise UnavailableError(f"kvxferd is draining: no new {what}")

    def owned_pool(self, pool_id: str, session_id: str) -> Pool:
        """The pool, if the calling session registered it (NOT_FOUND, PERMISSION_DENIED)."""
        pool = self._pools.get(pool_id)
        check_owner(pool.session_id, session_id, f"pool {pool_id!r}")
        return pool

    def keyed_pool(self, pool_id: str, session_id: str, offer_key: bytes) -> Pool:
        """The pool, if the caller registered it or (another session of the same engine)
        holds its offer key."""
        if not offer_key:
            return self.owned_pool(pool_id, session_id)
        pool = self._pools.get(pool_id)
        if not hmac.compare_digest(pool.offer_key, offer_key):
            raise PermissionDeniedError(f"wrong offer_key for pool {pool_id!r}")
        return pool

    @staticmethod
    def check_offerer(pool: Pool, session_id: str, offer_key: bytes, what: str) -> None:
        """The caller may act on ``what`` (an offer of ``pool``): it owns the pool or holds its key."""
        if pool.session_id != session_id and not (offer_key and hmac.compare_digest(pool.offer_key, offer_key)):
            raise PermissionDeniedError(f"{what} is another engine session's")
