"""A hybrid model's state components (SGLang's ``KVArgs.state_*``) as kvxfer pools.

Beside its KV pages a hybrid model keeps state SGLang lists as components, each a kind
(``StateType``: a Mamba layer's conv and SSM rows, a sliding-window layer's pages, ...) and
buffers of rows: row ``r`` of a component is ``state_item_lens[c][i]`` bytes at
``r * item_len`` of each buffer ``i``. Both sides name, per request, the rows it uses of each
component (its ``state_indices``), in the same order, and the rows move index for index.

Each component is a pool of its own:

- sliding-window pages laid out like the KV pages (``swa`` in ``NHD``) declare their heads,
  so they move between any tensor parallelism, head by head, as the KV pages do;
- every other kind moves row for row, as it is: only between ranks holding the same shard
  (equal attention TP), which its pool's layout states (the daemons refuse other pairs).

A component whose rows are not whole rows of its buffers (``dsa_tail``: a live subrange of a
ring row) is refused where SGLang builds the manager.

>>> [rows.tolist() for rows in rows_of([None, [3], np.array([4, 5], dtype=np.int32)], 3)]
[[], [3], [4, 5]]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvxfer.errors import IncompatibleError
from kvxfer.layout import Layout, ModelInfo

from .._results import Pool
from ._memory import kv_layout, row_layout

__all__ = ["StateComponent", "rows_of", "state_kinds", "state_layouts"]

#: SGLang's state kinds whose indices are whole rows (pages or request slots) of their buffers.
ROW_KINDS = frozenset(
    {
        "mamba", "swa", "dsa", "qsa_pending", "qsa_compressed", "swa_ring", "c128_state",
        "request_row", "block_scale", "block_scale_swa", "minimax_index_k", "minimax_dense_kv",
    }
)  # fmt: skip


@dataclass(frozen=True)
class StateComponent:
    """One state component of the rank's model, registered as ``pool``."""

    kind: str
    pool: Pool

    @property
    def mappable(self) -> bool:
        """Whether its rows move between ranks of other tensor parallelism (heads declared)."""
        return self.pool.layout.geometry is not None


def state_layouts(args: Any, kv_model: ModelInfo, total_heads: int) -> list[tuple[str, Layout]]:
    """The layout of each state component SGLang declared in ``args`` (its ``KVArgs``), with
    its kind; ``kv_model``: the KV pool's model facts (page tokens, the rank's parallelism)."""
    layouts = []
    for i, kind in enumerate(state_kinds(args)):
        items, lens = args.state_item_lens[i], args.state_data_lens[i]
        if kind == "swa" and getattr(args, "swa_kv_cache_layout", None) == "nhd" and len(set(items)) == 1:
            layout = kv_layout(items, lens, replace(kv_model, kv_format="sglang-swa-nhd"), total_heads)
        else:
            shard = ModelInfo(tp_size=kv_model.tp_size, tp_rank=kv_model.tp_rank, kv_format=f"sglang-state-{kind}")
            layout = row_layout(items, lens, shard)
        layouts.append((kind, layout))
    return layouts


def state_kinds(args: Any) -> list[str]:
    """The kinds of the state components in ``args``, in SGLang's order; refuses a kind whose
    indices are not whole rows."""
    kinds = [str(getattr(t, "value", t)) for t in getattr(args, "state_types", None) or []]
    for kind in kinds:
        if kind not in ROW_KINDS:
            raise IncompatibleError(
                f"SGLang's {kind!r} model state is not moved by kvxfer's SGLang backend in this release"
            )
    return kinds


def rows_of(state_indices: Any, count: int) -> list[np.ndarray[Any, Any]]:
    """SGLang's ``state_indices`` (a list parallel to the components; an entry may be None, a
    list, a numpy array or a CPU tensor) as ``count`` int64 arrays, empty where none."""
    given = list(state_indices or [])
    rows = []
    for i in range(count):
        entry = given[i] if i < len(given) else None
        rows.append(np.empty(0, np.int64) if entry is None else np.asarray(entry, dtype=np.int64).reshape(-1))
    return rows
