"""A decode engine's pull: check the ticket against the destination, then run it as a local
copy (the ticket names this daemon) or a remote pull (it names another), under one deadline,
as one transfer record.

A pull retried with the id of one that already landed (its answer was lost) is answered again
from the record and moves nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import (
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    IncompatibleError,
    InvalidRequestError,
    KvxferError,
    UnavailableError,
)
from kvxfer.layout import signature_mismatch
from kvxfer.proto import common_pb2
from kvxfer.ticket import Ticket

from .._asks import PullAsk
from .._transfers import TransferRecord, TransferTable, described
from ..memory.block_ids import check_block_ids
from ..memory.pools import Pool
from .local import LocalHandoff
from .order import PullOrder
from .remote_pull import RemotePull
from .shared import SharedReads

__all__ = ["Pulls"]


class Pulls:
    def __init__(
        self,
        daemon_id: str,
        transfers: TransferTable,
        local: LocalHandoff,
        remote: RemotePull | None,
        tell_landed: Callable[[Pool, str, int], None] | None = None,
    ) -> None:
        #: Tells a destination's engine that layers of a layer-wise transfer landed.
        self.tell_landed = tell_landed
        self.daemon_id = daemon_id
        self.transfers = transfers
        self.local = local
        self.remote = remote
        self.shared = SharedReads(local.copy_blocks)

    async def run_pull(self, ask: PullAsk, dst: Pool, dst_ids: npt.NDArray[np.int64]) -> TransferRecord:
        """Move the ticket's blocks (those at ``ask.indices`` of its list, or all) into the
        destination blocks ``dst_ids`` (``ask.block_ids`` as checked against ``dst``) within
        its timeout; returns the finished record (see :class:`~kvxferd._asks.PullAsk`)."""
        ticket, transfer_id, indices, timeout_s = ask.ticket, ask.transfer_id, ask.indices, ask.timeout_s
        pushed_by = ask.pushed_by
        offered = self.local.offers.offers.get(ticket.offer_id) if ticket.daemon_id == self.daemon_id else None
        _check_against(ticket, dst, dst_ids, indices, offered.pool if offered is not None else None)
        # Only a caller's own id can come back as a retry: a fresh one is never asked for again.
        dst_key = _destination_key(dst.pool_id, dst_ids, indices) if transfer_id else ""
        if transfer_id:
            done = self.transfers.succeeded_pull(transfer_id)
            if done is not None:
                # A retry of a pull that already landed: answer again, move nothing. A
                # different destination under the same id is a client bug.
                if done.dst_key != dst_key or done.offer_id != ticket.offer_id:
                    raise AlreadyExistsError(f"transfer {transfer_id!r} already moved another offer or destination")
                return done
        transfer_id = transfer_id or "xfer-" + secrets.token_hex(8)
        local = ticket.daemon_id == self.daemon_id
        if not local and self.remote is None:
            raise UnavailableError("the UCX data plane is not available (install kvxfer[ucx] or a cu12/cu13 extra)")
        record = TransferRecord(
            transfer_id,
            "decode",
            common_pb2.TRANSFER_PATH_LOCAL if local else common_pb2.TRANSFER_PATH_REMOTE,
            ticket.offer_id,
            peer_daemon_id="" if local else ticket.daemon_id,
            nbytes=len(dst_ids) * dst.layout.bytes_per_block,
            pools=(dst.pool_id,),
            dst_key=dst_key,
            mode="push" if pushed_by else "pull",
            mode_reason=f"pushed by {pushed_by}" if pushed_by else "the engine pulled a ticket",
        )
        if self.tell_landed is not None:
            tell = self.tell_landed
            record.on_layers = lambda layers: tell(dst, record.transfer_id, layers)
        self.transfers.begin(record)
        try:
            with dst.in_use():
                # Only this deadline raises TimeoutError here: every step's own deadline raises
                # DeadlineExceededError naming that step (see ``steps.within``).
                async with asyncio.timeout(timeout_s) as deadline:
                    order = PullOrder(record, ticket, dst, dst_ids, indices, timeout_s, deadline)
                    if local:
                        await self.local.copy_offer(order)
                    else:
                        await self._pull_remote(order)
        except KvxferError as exc:  # before TimeoutError: DeadlineExceededError is one
            self.transfers.end(record, common_pb2.TRANSFER_STATE_FAILED, str(exc), exc)
            raise _about(exc, record) from None
        except TimeoutError:
            self.transfers.end(
                record, common_pb2.TRANSFER_STATE_FAILED, f"deadline of {timeout_s}s exceeded", TimeoutError()
            )
            late = DeadlineExceededError(f"pull {transfer_id} did not finish within {timeout_s}s")
            raise _about(late, record) from None
        except asyncio.CancelledError:
            self.transfers.end(record, common_pb2.TRANSFER_STATE_CANCELLED, "cancelled")
            raise _about(CancelledError(f"pull {transfer_id} was cancelled"), record) from None
        except Exception as exc:
            self.transfers.end(record, common_pb2.TRANSFER_STATE_FAILED, described(exc), exc)
            raise
        self.transfers.end(record, common_pb2.TRANSFER_STATE_SUCCEEDED)
        return record

    async def _pull_remote(self, order: PullOrder) -> None:
        """A remote pull, sharing its wire transfer with other readers of the same bytes
        behind this daemon where the ticket has several readers (:mod:`.shared`)."""
        assert self.remote is not None and order.deadline is not None
        record, ticket, dst, dst_ids, indices = order.record, order.ticket, order.dst, order.dst_ids, order.indices
        deadline = order.deadline
        lead = None
        if ticket.readers > 1:
            key = SharedReads.key(ticket, dst, dst_ids, indices)
            if await self.shared.join(key, record, dst, dst_ids, deadline):
                return
            lead = self.shared.lead(key, record, dst, dst_ids, ticket.readers)
        hand_on = lead.serve_joiners if lead is not None else None
        try:
            await self.remote.fetch(order, hand_on)
        except BaseException as exc:
            if lead is not None:
                lead.ended(exc)
            raise
        if lead is not None:
            lead.ended(None)


def _check_against(
    ticket: Ticket,
    dst: Pool,
    dst_ids: np.ndarray[Any, Any],
    indices: np.ndarray[Any, Any] | None,
    src: Pool | None = None,
) -> None:
    """The ticket fits the destination: block count, layout fingerprint, byte count. With a
    declared geometry, counts and bytes depend on the mapping: the planner checks them.
    ``src``: the offered pool, when it is on this daemon (a refusal then names the difference)."""
    mapped = dst.layout.geometry is not None
    if indices is None and len(dst_ids) != ticket.num_blocks and not mapped:
        raise InvalidRequestError(f"ticket holds {ticket.num_blocks} blocks, {len(dst_ids)} destination ids given")
    if indices is not None:
        if len(dst_ids) != len(indices) and not mapped:
            raise InvalidRequestError(f"{len(indices)} offer_block_indices, {len(dst_ids)} destination ids given")
        check_block_ids(indices, ticket.num_blocks, "offer_block_indices")  # the offerer checks again
    if ticket.fingerprint != dst.fingerprint:
        why = signature_mismatch(src.layout.signature(), dst.layout.signature()) if src is not None else None
        raise IncompatibleError(
            f"layout fingerprint mismatch: offer {ticket.fingerprint}, destination pool {dst.fingerprint}: "
            + (why or "the pools differ in block sizes, model, dtype, TP, geometry or KV format (kvxferctl pools)")
        )
    # Same fingerprint, same bytes per block: a ticket's byte count is derived, never trusted.
    if not mapped and ticket.total_bytes != ticket.num_blocks * dst.layout.bytes_per_block:
        raise InvalidRequestError(
            f"malformed ticket: total_bytes {ticket.total_bytes} is not {ticket.num_blocks} blocks of "
            f"{dst.layout.bytes_per_block} bytes"
        )


def _about(err: KvxferError, record: TransferRecord) -> KvxferError:
    """``err`` naming the pull's transfer and offer, and whether UCX may still write its
    destination (the engine must then quarantine those blocks)."""
    err.transfer_id = record.transfer_id
    err.offer_id = record.offer_id
    err.may_still_write = record.may_still_write
    return err


def _destination_key(pool_id: str, ids: np.ndarray[Any, Any], indices: np.ndarray[Any, Any] | None) -> str:
    """Identifies a pull's source positions and destination (pool and block ids) for
    idempotent retries."""
    h = hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=16)
    if indices is not None:
        h.update(b"|" + np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    return pool_id + ":" + h.hexdigest()
