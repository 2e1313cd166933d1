"""The SDK's check of an engine's block ids: a plain list of a few ints is checked without
numpy, anything else through it, and both refuse the same ids the same way."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvxfer.errors import InvalidRequestError
from kvxfer.layout import MAX_BLOCKS
from kvxfer_client._client import _block_ids


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "non-empty"),
        ([-1], "must be in"),
        ([MAX_BLOCKS], "must be in"),
        ([True], "must be integers"),
        ([1.0], "must be integers"),
        ([[1, 2]], "1-D"),
        ([3, -2, 5], "must be in"),
    ],
)
@pytest.mark.parametrize("as_", [list, tuple, np.array])
def test_a_bad_id_is_refused_whether_given_as_a_list_or_not(ids: list[Any], match: str, as_: Any) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        _block_ids(as_(ids), "ids")


@pytest.mark.parametrize("n", [1, 64, 65, 1000])
def test_good_ids_come_back_as_the_same_list_of_ints_by_either_path(n: int) -> None:
    ids = list(range(MAX_BLOCKS - n, MAX_BLOCKS))
    checked = _block_ids(ids, "ids")
    assert checked == ids and checked is not ids
    assert all(type(i) is int for i in checked)
    assert _block_ids(np.array(ids, dtype=np.int32), "ids") == ids
