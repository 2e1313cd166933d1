"""Cancel, from an engine or an operator: a receive waiting for its push, a running transfer
(our pull, or a peer's pull of our offer: the peer then sees its pull fail), or an offer
nobody is pulling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvxfer.errors import PermissionDeniedError
from kvxfer.proto import common_pb2

if TYPE_CHECKING:
    from ._config import Settings
    from ._offers import OfferTable
    from ._transfers import TransferTable
    from .handoff.push import PushHandoff
    from .memory.pools import PoolRegistry

__all__ = ["CancelOutcome", "cancel"]


@dataclass(frozen=True)
class CancelOutcome:
    """What a cancel did: ``found`` the id at all; ``cancelled`` it; UCX ``may_still_write``
    the destination of a cancelled pull; ``detail`` for an operator."""

    found: bool
    cancelled: bool
    may_still_write: bool = False
    detail: str = ""


class _Node(Protocol):
    """What a cancel touches (kvxferd's Node)."""

    daemon_id: str
    settings: Settings
    pushes: PushHandoff
    transfers: TransferTable
    pools: PoolRegistry
    offers: OfferTable

    def unconfirmed_receives(self) -> int: ...


async def cancel(node: _Node, target_id: str, session_id: str | None = None) -> CancelOutcome:
    """Cancel a running transfer (our pull, or a peer's pull of our offer: the peer then
    sees its pull fail), or release an offer nobody is pulling. ``session_id``: an engine
    acts only on its own pools' transfers and offers (None: an operator)."""
    if node.pushes.table.cancel(target_id, session_id):
        return CancelOutcome(True, True, detail="receive cancelled before its push came")
    records = node.transfers.find(target_id)
    if records:
        if session_id is not None:
            owners = {node.pools.pools[p].session_id for r in records for p in r.pools if p in node.pools.pools}
            if session_id not in owners:
                raise PermissionDeniedError(f"transfer {target_id!r} touches no pool of this engine session")
        unconfirmed = node.unconfirmed_receives()
        detail = f"transfer {target_id} was cancelled on daemon {node.daemon_id}"
        stuck = await node.transfers.cancel(records, detail, node.settings.peer_timeout_s)
        may_still_write = stuck or node.unconfirmed_receives() > unconfirmed
        note = " (UCX may still write its destination)" if may_still_write else ""
        return CancelOutcome(True, True, may_still_write, "transfer cancelled" + note)
    offer = node.offers.offers.get(target_id)
    if offer is None:
        return CancelOutcome(False, False, detail=f"no running transfer or live offer {target_id!r}")
    if offer.state != "offered":
        return CancelOutcome(True, False, detail="offer is being pulled; cancel its transfer")
    by = "an operator" if session_id is None else "the engine"
    node.offers.release_unpulled(target_id, common_pb2.RELEASE_REASON_CANCELLED, f"cancelled by {by}", session_id)
    return CancelOutcome(True, True, detail="offer released")
