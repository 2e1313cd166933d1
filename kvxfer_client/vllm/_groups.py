"""Hybrid models' KV-cache groups (vLLM's hybrid KV-cache manager; the connector is ``SupportsHMA``).

A model with sliding-window layers beside full-attention ones (or other kinds of layers) has
one KV-cache group per kind. Every group takes its blocks from one shared pool of block ids,
so a block id names one group's block in every KV tensor, and moving a block moves that
group's KV. What a sliding-window group no longer needs, vLLM has already given back: its
list holds the null block (id 0) there, always a run at its start.

The prefill offers, per group, the blocks from its first real one (:func:`offered`), group
after group in one offer, and tells the decode engine the span of each in
``kv_transfer_params["kvxfer_groups"]`` (``[[first, end], ...]``: block positions of the
request). The decode engine pulls, per group, the positions where it allocated a new block
(not the null block, not one its prefix cache holds) from the offer (:func:`landing`). A
position the decode engine needs and the prefill does not hold fails the load.

>>> spans, ids = offered([[0, 0, 7, 8], [3, 4, 5, 6]])   # sliding window: 2 blocks dropped
>>> spans, ids
([[2, 4], [0, 4]], [7, 8, 3, 4, 5, 6])
>>> # The decode side: the window's blocks and the full group's are new here, except its
>>> # first block (a prefix-cache hit).
>>> landing(spans, [[None, None, 20, 21], [30, 31, 32, 33]], [[False, False, True, True], [False, True, True, True]])
((0, 1, 3, 4, 5), (20, 21, 31, 32, 33))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["GROUPS_KEY", "NULL_BLOCK", "landing", "offered", "spans_of"]

#: Key of the per-group spans inside ``kv_transfer_params``.
GROUPS_KEY = "kvxfer_groups"
#: vLLM's null block: the first block of its pool, which a group's list holds where the
#: group keeps nothing (a sliding window's dropped blocks).
NULL_BLOCK = 0


def offered(groups: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """Each group's span ``[first real block, end)`` and the blocks offered, group after group.
    ValueError for a null block after a real one (vLLM drops a window's blocks from the start).
    """
    spans: list[list[int]] = []
    ids: list[int] = []
    for group in groups:
        first = next((i for i, b in enumerate(group) if b != NULL_BLOCK), len(group))
        kept = list(group[first:])
        if NULL_BLOCK in kept:
            raise ValueError(f"a KV-cache group holds the null block after a real one: {list(group)}")
        spans.append([first, len(group)])
        ids += kept
    return spans, ids


def spans_of(value: Any, groups: int, offered_blocks: int) -> list[tuple[int, int]] | str:
    """A router-carried ``kvxfer_groups`` checked against this engine's ``groups`` and the
    ticket's block count: the spans, or what is wrong with them.

    >>> spans_of([[2, 4], [0, 4]], 2, 6)
    [(2, 4), (0, 4)]
    >>> spans_of([[0, 9]], 2, 9)
    'kvxfer_groups: 1 group(s) offered, this engine has 2 KV-cache groups (is it serving the same model?)'
    """
    if not isinstance(value, list) or not all(
        isinstance(s, list) and len(s) == 2 and all(type(v) is int for v in s) and 0 <= s[0] <= s[1] for s in value
    ):
        return "kvxfer_groups must be a list of [first, end] block positions"
    if len(value) != groups:
        return (
            f"kvxfer_groups: {len(value)} group(s) offered, this engine has {groups} KV-cache groups "
            "(is it serving the same model?)"
        )
    spans = [(int(a), int(b)) for a, b in value]
    if sum(b - a for a, b in spans) != offered_blocks:
        return f"kvxfer_groups: the spans hold {sum(b - a for a, b in spans)} blocks, the ticket {offered_blocks}"
    return spans


def landing(
    spans: Sequence[Sequence[int]], dst: Sequence[Sequence[int | None]], new: Sequence[Sequence[bool]]
) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """Offer positions to pull and the blocks they land in: per group, every position whose
    decode block is new (``dst`` None: the null block), within the offered span; or why the
    load cannot run (a new block the prefill does not hold)."""
    indices: list[int] = []
    blocks: list[int] = []
    base = 0
    for g, ((first, end), ids, fresh) in enumerate(zip(spans, dst, new, strict=True)):
        for i, (block, wanted) in enumerate(zip(ids, fresh, strict=True)):
            if block is None or not wanted or i >= end:
                continue  # the null block, a prefix-cache hit, or past the prompt's computed blocks
            if i < first:
                return (
                    f"KV-cache group {g}: block {i} is needed here but the prefill engine no longer held it "
                    "(its window is smaller than this engine's?)"
                )
            indices.append(base + i - first)
            blocks.append(block)
        base += end - first
    return tuple(indices), tuple(blocks)
