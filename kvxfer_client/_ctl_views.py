"""What kvxferctl prints: tables of the daemon's pools, offers, peers, tier and transfers, or
the same rows as JSON (``--json``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kvxfer.proto import admin_pb2, common_pb2


def table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def printable(value: Any) -> Any:
    """``value`` as a terminal may show it: a string's control and other unprintable characters
    escaped (an escape sequence in a registry record must not reach the operator's terminal).

    >>> printable("n1\\x1b[2J"), printable(3)
    ('n1\\\\x1b[2J', 3)
    """
    if not isinstance(value, str):
        return value
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def state(value: int) -> str:
    return common_pb2.TransferState.Name(value).removeprefix("TRANSFER_STATE_").lower()  # type: ignore[arg-type]


def path(value: int) -> str:
    return common_pb2.TransferPath.Name(value).removeprefix("TRANSFER_PATH_").lower()  # type: ignore[arg-type]


def fields(msg: Any) -> dict[str, Any]:
    """A message's fields by name with their raw values (numbers stay numbers, unlike
    ``MessageToDict``, which writes 64-bit integers as strings)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        out[field.name] = list(value) if field.is_repeated else value
    return out


def shown(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: SHOW[k](v) if k in SHOW else v for k, v in row.items()} for row in rows]


def show_rows(args: argparse.Namespace, title: str, rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    if args.json:
        print(json.dumps(rows))
    else:
        if title:
            print(f"{title}:")
        print(table(shown(rows), columns))


def tier_batch(batch: admin_pb2.TierEventBatch) -> dict[str, Any]:
    """A tier event batch as JSON: keys in hex, by namespace."""
    return {
        "stored": {t.namespace: [k.hex() for k in t.keys] for t in batch.stored},
        "removed": {t.namespace: [k.hex() for k in t.keys] for t in batch.removed},
        "overflowed": batch.overflowed,
    }


POOL_COLUMNS = ("pool", "engine", "memory", "device", "blocks", "regions", "bytes", "offers", "fingerprint")
OFFER_COLUMNS = ("offer", "pool", "blocks", "bytes", "state", "lease_left_s")
PEER_COLUMNS = ("peer", "address", "host", "state", "version", "transports", "hello_age_s")
TIER_COLUMNS = (
    "namespace",
    "label",
    "chunks",
    "bytes",
    "hits",
    "misses",
    "hit_rate",
    "evictions",
    "disk_chunks",
    "disk_hits",
    "disk_failures",
)
TRANSFER_COLUMNS = (
    "transfer",
    "role",
    "mode",
    "path",
    "transport",
    "state",
    "bytes",
    "duration_s",
    "gb_per_s",
    "peer",
    "mapping",
    "integrity",
    "detail",
)


def integrity(t: admin_pb2.TransferInfo) -> str:
    """The transfer's block checks in a word or three: ``full 64 ok``, ``sampled 4 mismatch``,
    ``not checked`` (the JSON fields say why).

    >>> integrity(admin_pb2.TransferInfo(integrity_mode="sampled", integrity_blocks=4, integrity_result="ok"))
    'sampled 4 ok'
    """
    if not t.integrity_result or t.integrity_result.startswith("not checked"):
        return "not checked" if t.integrity_result else ""
    return f"{t.integrity_mode} {t.integrity_blocks} {t.integrity_result}"


#: How the table shows a raw value (columns not named here are shown as they are).
SHOW: dict[str, Any] = {
    "bytes": human_bytes,
    "fingerprint": lambda v: v[:12],
    "lease_left_s": lambda v: f"{v:.1f}",
    "duration_s": lambda v: f"{v:.4f}",
    "gb_per_s": lambda v: "" if v is None else f"{v:.2f}",
    "transports": ",".join,
    "hello_age_s": lambda v: f"{v:.0f}",
}
