"""Subscribe to served vLLM engines' KV events (``--kv-events-config``, ZMQ) and print each event
as a JSON line, as a KV-aware router would receive them.

    python -m bench.kv_events_listen tcp://127.0.0.1:5557 [tcp://...]

An engine whose ``endpoint`` names a host (not ``*``) connects its publisher to it, so this
binds each address given (a router collecting many engines' events binds one); for engines
that bind (``tcp://*:PORT``), ``--connect`` connects instead.

Each line: ``{"endpoint": ..., "type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared",
"medium": ..., "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...]}`` (hashes
as vLLM sends them: ints, or hex for bytes). Prints ``{"ready": true}`` once subscribed. Runs
in the vLLM venv (it decodes with vLLM's own event classes).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def main() -> None:
    context = zmq.Context()
    poller = zmq.Poller()
    sockets = {}
    connect = "--connect" in sys.argv[1:]
    for endpoint in (a for a in sys.argv[1:] if a != "--connect"):
        sub = context.socket(zmq.SUB)
        sub.connect(endpoint) if connect else sub.bind(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        poller.register(sub, zmq.POLLIN)
        sockets[sub] = endpoint
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    print(json.dumps({"ready": True}), flush=True)
    while True:
        for sub, _ in poller.poll():
            _, _, payload = sub.recv_multipart()
            for event in decoder.decode(payload).events:
                line = {"endpoint": sockets[sub], "type": type(event).__name__}
                for key in ("medium", "block_hashes", "parent_block_hash", "token_ids"):
                    line[key] = _plain(getattr(event, key, None))
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
