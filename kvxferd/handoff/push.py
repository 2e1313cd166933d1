"""Push mode: transfers the prefill side starts, matched on a transfer id the router chose.

Two halves meet here, in either order (engine.proto, ``Push`` and ``Receive``):

* an *expectation*: a decode engine's Receive, waiting with its destination and deadline
  (and, optionally, the one daemon it accepts a push from);
* an *announcement*: a prefill daemon's offer under that id, as a ticket (``Announce`` from a
  peer, or straight from :meth:`Node.push` when both engines share this daemon).

When both are here, the expectation's own task pulls the ticket exactly as Pull would (same
record, outcome table and errors), so a push never adds a protocol of its own to get wrong.
Whichever half came first waits: an expectation until its deadline (then
DeadlineExceededError naming the push that never came), an announcement until its offer's
lease (then it is forgotten; the offer expires on its own daemon). Announcements are kept per
(transfer id, announcing daemon), so a peer that guesses an id cannot crowd out the daemon the
decode engine named; both tables are bounded.

>>> async def demo() -> str:
...     table = PushTable(max_waiting=8)
...     waiting = asyncio.ensure_future(table.wait("t-1", "session", "", timeout_s=5))
...     await asyncio.sleep(0)
...     table.announce("t-1", "ticket", lease_s=30, from_daemon_id="prefill-0")
...     return (await waiting).from_daemon_id
>>> asyncio.run(demo())
'prefill-0'
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvxfer.errors import (
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    KvxferError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from kvxfer.proto import peer_pb2
from kvxfer.ticket import Ticket

from .._admission import Admission
from .._asks import OfferAsk, PullAsk, ReceiveAsk
from .._config import Settings
from .._log import log_event
from .._offers import Offer
from .._transfers import TransferRecord
from ..memory.block_ids import check_block_ids
from ..peer.directory import PeerDirectory

__all__ = ["Announcement", "PushHandoff", "PushTable", "Pushed"]

#: Expectations, and announcements, one daemon holds at once (each table).
MAX_WAITING = 4096


@dataclass
class Announcement:
    """An offer announced for a transfer id: its ticket and who announced it."""

    ticket: Any  # kvxfer.ticket.Ticket (anything, for the table)
    from_daemon_id: str
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


@dataclass
class _Expectation:
    session_id: str
    from_daemon_id: str
    arrived: asyncio.Future[Announcement]


class PushTable:
    def __init__(self, max_waiting: int = MAX_WAITING) -> None:
        self.max_waiting = max_waiting
        self._expected: dict[str, _Expectation] = {}
        self._announced: dict[str, dict[str, Announcement]] = {}  # transfer id -> daemon id ->

    @property
    def held(self) -> int:
        """Announcements waiting for their expectation."""
        return sum(len(by_daemon) for by_daemon in self._announced.values())

    def announce(self, transfer_id: str, ticket: Any, lease_s: float, from_daemon_id: str) -> bool:
        """Hand an announced offer to the expectation waiting for it (True), or hold it for
        one until ``lease_s`` has passed (False)."""
        expected = self._expected.get(transfer_id)
        if expected is not None and not expected.arrived.done():
            if expected.from_daemon_id and expected.from_daemon_id != from_daemon_id:
                raise PermissionDeniedError(
                    f"transfer {transfer_id} expects a push from {expected.from_daemon_id}, not {from_daemon_id}"
                )
            expected.arrived.set_result(Announcement(ticket, from_daemon_id))
            return True
        by_daemon = self._announced.setdefault(transfer_id, {})
        if from_daemon_id in by_daemon:
            raise AlreadyExistsError(f"{from_daemon_id} already announced transfer {transfer_id}")
        if self.held >= self.max_waiting:
            raise ResourceExhaustedError(f"{self.max_waiting} pushes already wait for their receiver")
        held = by_daemon[from_daemon_id] = Announcement(ticket, from_daemon_id)
        held.timer = asyncio.get_running_loop().call_later(lease_s, self._expire, transfer_id, from_daemon_id)
        return False

    def _expire(self, transfer_id: str, from_daemon_id: str) -> None:
        if self._take(transfer_id, from_daemon_id) is not None:
            log_event("push.expired", logging.INFO, transfer_id=transfer_id, from_daemon=from_daemon_id)

    def _take(self, transfer_id: str, from_daemon_id: str) -> Announcement | None:
        """Remove and return a held announcement (any daemon's when ``from_daemon_id`` is "")."""
        by_daemon = self._announced.get(transfer_id)
        if not by_daemon:
            return None
        key = from_daemon_id or next(iter(by_daemon))
        held = by_daemon.pop(key, None)
        if not by_daemon:
            del self._announced[transfer_id]
        if held is not None and held.timer is not None:
            held.timer.cancel()
        return held

    async def wait(self, transfer_id: str, session_id: str, from_daemon_id: str, timeout_s: float) -> Announcement:
        """The announcement of ``transfer_id`` (from ``from_daemon_id`` only, unless ""): a
        held one at once, else the first to come within ``timeout_s``."""
        held = self._take(transfer_id, from_daemon_id)
        if held is not None:
            return held
        if transfer_id in self._expected:
            raise AlreadyExistsError(f"transfer {transfer_id} is already expected")
        if len(self._expected) >= self.max_waiting:
            raise ResourceExhaustedError(f"{self.max_waiting} receives already wait for their push")
        expected = _Expectation(session_id, from_daemon_id, asyncio.get_running_loop().create_future())
        self._expected[transfer_id] = expected
        log_event("push.expected", logging.DEBUG, transfer_id=transfer_id, from_daemon=from_daemon_id or "-")
        try:
            async with asyncio.timeout(timeout_s):
                return await expected.arrived
        except TimeoutError:
            source = f" from {from_daemon_id}" if from_daemon_id else ""
            raise DeadlineExceededError(
                f"no push{source} for transfer {transfer_id} came within {timeout_s}s"
            ) from None
        except asyncio.CancelledError:
            if expected.arrived.cancelled():  # cancel() below, not the caller's own cancellation
                raise CancelledError(f"receive of transfer {transfer_id} was cancelled") from None
            raise
        finally:
            del self._expected[transfer_id]

    def cancel(self, transfer_id: str, session_id: str | None) -> bool:
        """Stop a Receive still waiting for its push (``session_id``: only its own engine's;
        None: an operator). False when none waits."""
        expected = self._expected.get(transfer_id)
        if expected is None or expected.arrived.done():
            return False
        if session_id is not None and expected.session_id != session_id:
            raise PermissionDeniedError(f"transfer {transfer_id!r} is expected by another engine session")
        expected.arrived.cancel()
        return True


class PushNode(Protocol):
    """What :class:`PushHandoff` uses of the daemon (kvxferd's Node)."""

    daemon_id: str
    peer_address: str
    settings: Settings
    peers: PeerDirectory
    ucx: Any
    admission: Admission

    def offer(self, ask: OfferAsk) -> tuple[Offer, Ticket]: ...

    async def pull(self, ask: PullAsk) -> TransferRecord: ...


@dataclass(frozen=True)
class Pushed:
    """What a Push answers: the offer, its ticket, and the mode the pair ended up in."""

    offer: Offer
    ticket: Ticket
    mode: str  # "push" or "pull"
    mode_reason: str


class PushHandoff:
    """Push and Receive for the engines, Announce for peers, on top of offers and pulls."""

    def __init__(self, node: PushNode) -> None:
        self.node = node
        self.table = PushTable()

    async def push(self, ask: OfferAsk, transfer_id: str, to_peer_address: str) -> Pushed:
        """Offer the blocks and announce them for ``transfer_id`` to the daemon at
        ``to_peer_address`` (this one, for an engine beside us). Where that daemon cannot take
        the push, the offer stands and the answer says "pull" and why."""
        node = self.node
        offer, ticket = node.offer(dataclasses.replace(ask, chosen=None, readers=1))
        lease_s = ask.lease_s
        offer.pushed_to = f"pushed to {to_peer_address} as transfer {transfer_id}"
        if to_peer_address == node.peer_address:
            self.table.announce(transfer_id, ticket, lease_s, node.daemon_id)
            return Pushed(offer, ticket, "push", "the decode engine shares this daemon")
        if node.ucx is None:
            return Pushed(offer, ticket, "pull", "this daemon has no UCX data plane: a local engine pulls the ticket")
        announcement = peer_pb2.PushAnnouncement(
            transfer_id=transfer_id, ticket=ticket.to_proto(), lease_s=lease_s, daemon_id=node.daemon_id
        )
        try:
            peer = await node.peers.dial(to_peer_address)
            await peer.announce(announcement, node.settings.peer_timeout_s)
        except KvxferError as exc:
            log_event("push.fell_back", logging.INFO, transfer_id=transfer_id, to=to_peer_address, detail=str(exc))
            return Pushed(offer, ticket, "pull", f"{to_peer_address} did not take the push ({exc}): pull the ticket")
        return Pushed(offer, ticket, "push", f"announced to {peer.daemon_id}")

    async def receive(self, ask: ReceiveAsk) -> TransferRecord:
        """Wait for the push of ``transfer_id`` and pull it (or the pushed blocks at
        ``offer_block_indices``) into the blocks: one deadline for both. The destination is
        checked before the wait, so a wrong one fails at once."""
        self.node.admission.admit("pulls")
        pool = self.node.admission.owned_pool(ask.pool_id, ask.session_id)
        check_block_ids(ask.block_ids, pool.layout.num_blocks, "receive destination")
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + ask.timeout_s
        announced = await self.table.wait(ask.transfer_id, ask.session_id, ask.from_daemon_id, ask.timeout_s)
        left = max(ends_at - loop.time(), 1e-3)
        pull = PullAsk(
            ask.session_id,
            ask.pool_id,
            announced.ticket,
            ask.block_ids,
            left,
            ask.transfer_id,
            ask.indices,
            announced.from_daemon_id,
        )
        return await self.node.pull(pull)

    def announced(self, transfer_id: str, ticket: Ticket, lease_s: float, daemon_id: str) -> bool:
        """A peer's Announce (its fields checked for form): the peer said Hello, and the ticket
        is its own offer at its own address, so a push makes this daemon dial only the daemon
        that pushed. True when an engine was waiting for it."""
        peer = self.node.peers.known(daemon_id)
        if ticket.daemon_id != peer.daemon_id or ticket.peer_address != peer.address:
            raise PermissionDeniedError(
                f"daemon {peer.daemon_id} announced an offer of {ticket.daemon_id!r} at {ticket.peer_address}: "
                "a daemon pushes only its own offers"
            )
        return self.table.announce(transfer_id, ticket, lease_s, peer.daemon_id)
