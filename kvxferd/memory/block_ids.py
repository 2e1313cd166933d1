"""Block ids an engine or a peer names, checked against a pool before anything uses them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.errors import InvalidRequestError

__all__ = ["check_block_ids"]


def check_block_ids(ids: Sequence[int] | npt.NDArray[np.int64], num_blocks: int, what: str) -> npt.NDArray[np.int64]:
    """Validate block ids (non-empty, in range, no repeats) as one vectorised pass (plain
    Python for a few: numpy's per-call cost would be most of the work).

    >>> check_block_ids([3, 1], 4, "pull").tolist()
    [3, 1]
    >>> check_block_ids([3, 3], 4, "pull")
    Traceback (most recent call last):
    kvxfer_client.InvalidRequestError: pull: block ids repeat
    """
    if len(ids) <= _FEW_IDS:
        few = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
        if not few:
            raise InvalidRequestError(f"{what}: empty block list")
        lo, hi = min(few), max(few)
        _in_pool(lo, hi, num_blocks, what)
        if len(set(few)) != len(few):
            raise InvalidRequestError(f"{what}: block ids repeat")
        return np.array(few, dtype=np.int64)
    arr = np.asarray(ids, dtype=np.int64)
    _in_pool(int(arr.min()), int(arr.max()), num_blocks, what)
    ordered = np.sort(arr)
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise InvalidRequestError(f"{what}: block ids repeat")
    return arr


#: Up to this many block ids are checked in plain Python.
_FEW_IDS = 32


def _in_pool(lo: int, hi: int, num_blocks: int, what: str) -> None:
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise InvalidRequestError(f"{what}: block id {bad} outside the pool's 0..{num_blocks - 1}")
