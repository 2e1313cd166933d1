"""The quick start's two engines: a prefill that offers blocks, a decode that pulls them.

Each engine talks to its own node's daemon. The prefill prints its ticket on stdout (the
router's job in a real deployment), the decode reads it on stdin, pulls, and checks every
byte::

    python examples/quickstart.py prefill --socket /tmp/kvx-a.sock \\
      | python examples/quickstart.py decode --socket /tmp/kvx-b.sock

The pools are Llama-shaped (4 layers, K and V, 64 blocks of 16 KiB); the prefill offers blocks
10..17 and the decode pulls them into its blocks 40..47.

>>> fill(layer=1, kv=0, block=3)
34
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from kvxfer_client import HostBuffer, KvxferClient, Layout, Pool, Ticket

LAYERS, BLOCKS, BLOCK_BYTES = 4, 64, 16 << 10
SOURCE_IDS = list(range(10, 18))
DESTINATION_IDS = list(range(40, 48))


def fill(layer: int, kv: int, block: int) -> int:
    """The byte the prefill writes in one block of one layer's K or V."""
    return (layer * 31 + kv * 17 + block) % 251


def _pool(client: KvxferClient, name: str) -> tuple[list[np.ndarray[Any, Any]], Pool]:
    layout = Layout.paged_kv(num_layers=LAYERS, num_blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    buffers = [HostBuffer.create(size) for size in layout.buffer_sizes()]
    views = [b.array().reshape(2, BLOCKS, BLOCK_BYTES) for b in buffers]  # [K/V, block, bytes]
    return views, client.register_pool(buffers, layout, name=name)


def prefill(socket: str) -> None:
    with KvxferClient(socket, engine_name="quickstart-prefill") as client:
        views, pool = _pool(client, "prefill")
        for layer, view in enumerate(views):
            for kv in range(2):
                for block in SOURCE_IDS:
                    view[kv, block] = fill(layer, kv, block)
        ticket = client.offer(pool, SOURCE_IDS, lease_s=60)
        print(ticket.to_json(), flush=True)
        released = client.wait_released(ticket.offer_id, timeout_s=90)
        print(f"prefill: blocks released ({released.reason.name.lower()})", file=sys.stderr)


def decode(socket: str) -> None:
    ticket = Ticket.from_json(sys.stdin.readline())
    with KvxferClient(socket, engine_name="quickstart-decode") as client:
        views, pool = _pool(client, "decode")
        result = client.pull(ticket, pool, DESTINATION_IDS)
        for layer, view in enumerate(views):
            for kv in range(2):
                for src, dst in zip(SOURCE_IDS, DESTINATION_IDS, strict=True):
                    if not (view[kv, dst] == fill(layer, kv, src)).all():
                        sys.exit(f"decode: block {dst} of layer {layer} holds other bytes")
        print(f"decode: pulled {result.bytes} bytes over {result.transport}, every byte checked")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--socket", required=True, help="this engine's node daemon socket")
    args = parser.parse_args()
    prefill(args.socket) if args.role == "prefill" else decode(args.socket)


if __name__ == "__main__":
    main()
