"""What a failed block check says, and the fault that makes one.

Each mismatch is a :class:`DataLossError` naming the blocks (at most :data:`NAMED` of them,
and how many more) and saying that the destination is not filled.

>>> named(range(10))
'[0, 1, 2, 3, 4, 5, 6, 7] and 2 more'
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import DataLossError

from ._offers import Offer
from ._stream_sums import blocks_under
from ._transfers import TransferRecord
from .dataplane.plan import RegionTable, SidePlan, build_plan
from .memory.pools import Pool

__all__ = [
    "NAMED",
    "changed_after_offer",
    "distinct",
    "flip_first_bit",
    "landed_otherwise",
    "named",
    "stream_otherwise",
]

I64 = npt.NDArray[np.int64]
#: Blocks named in an error message (a mismatch of many says how many more).
NAMED = 8


def changed_after_offer(record: TransferRecord, offer: Offer, offer_pos: I64) -> DataLossError:
    """The blocks at ``offer_pos`` of the offer were written again since it was made."""
    return DataLossError(
        f"offer {offer.offer_id}: blocks {named(np.unique(offer.block_ids[offer_pos]))} changed after "
        "they were offered (the engine wrote them again before the pull ended): the destination is not filled",
        offer_id=offer.offer_id,
        transfer_id=record.transfer_id,
    )


def landed_otherwise(record: TransferRecord, dst_ids: I64, positions: I64) -> DataLossError:
    """The blocks at ``positions`` of the transfer landed other than the offer's digest says."""
    return DataLossError(
        f"blocks {named(np.unique(dst_ids[positions]))} (positions {named(np.unique(positions))} "
        f"of the transfer) landed with other bytes than offer {record.offer_id} held when it was written: "
        "changed at the source or corrupted on the way; the destination is not filled",
        transfer_id=record.transfer_id,
        offer_id=record.offer_id,
    )


def stream_otherwise(record: TransferRecord, dst: Pool, plan: SidePlan, window: int, picks: I64) -> DataLossError:
    """Windows ``picks`` of a remapped stream landed other than they left."""
    return DataLossError(
        f"blocks {named(blocks_under(dst, plan, window, picks))} (bytes "
        f"{named(picks * window)} onwards, {window} each, of the remapped stream) landed with "
        f"other bytes than offer {record.offer_id} sent: corrupted on the way; the destination is not filled",
        transfer_id=record.transfer_id,
        offer_id=record.offer_id,
    )


def flip_first_bit(dst: Pool, dst_ids: I64) -> None:
    """Fault injection (``before_check=corrupt``): flip a bit of the first landed block."""
    regions = dst.regions
    first = RegionTable(regions.buffer[:1], regions.offset[:1], regions.stride[:1], np.ones(1, np.int64))
    chunk = build_plan(first, dst_ids[:1], 1).chunks[0]
    memory, byte = dst.host_memory(), np.zeros(1, dtype=np.uint8)
    memory.gather(chunk, byte)
    memory.scatter(chunk, byte ^ np.uint8(1))


def distinct(values: I64) -> int:
    """How many different values: plain Python for a sample, numpy for every block of a pull."""
    return len(set(values.tolist())) if len(values) <= 64 else len(np.unique(values))


def named(values: Any) -> str:
    """Up to :data:`NAMED` values, and how many more."""
    listed = [int(v) for v in values]
    more = f" and {len(listed) - NAMED} more" if len(listed) > NAMED else ""
    return f"{listed[:NAMED]}{more}"
