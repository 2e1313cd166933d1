"""Run the example: same tokens with and without disaggregation, on both kvxfer paths.

``python -m examples.disagg_llm [--max-tokens 12]`` prints one JSON line per request and path
and exits 1 if any differs from the single-process reference.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bench.cluster import Cluster, EngineProcess

from . import model as m

#: Prompt lengths: shorter than a block, exactly one, several, and not multiples of 16.
PROMPT_LENGTHS = (5, 16, 37, 64, 100)


@dataclass
class Engines:
    prefill: EngineProcess
    decode_local: EngineProcess  # same daemon as the prefill engine
    decode_remote: EngineProcess  # the other daemon: the UCX path
    decode_tp2: EngineProcess  # the other daemon, two heads-major TP ranks: remapped pulls


@contextmanager
def engines(*daemon_args: str) -> Iterator[Engines]:
    """Two daemons (given ``daemon_args``); a prefill engine on the first, a decode engine on each."""
    module = "examples.disagg_llm.engine"
    with Cluster() as cluster:
        a, b = cluster.daemon("a", *daemon_args), cluster.daemon("b", *daemon_args)
        yield Engines(
            cluster.engine(a, "prefill", module, ["--role", "prefill", "--seed", "1"]),
            cluster.engine(a, "decode-local", module, ["--role", "decode", "--seed", "2"]),
            cluster.engine(b, "decode-remote", module, ["--role", "decode", "--seed", "3"]),
            cluster.engine(b, "decode-tp2", module, ["--role", "decode", "--seed", "4", "--tp", "2"]),
        )


def handoff(
    prefill: EngineProcess,
    decode: EngineProcess,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    flip: bool = False,
    readers: int = 1,
) -> dict[str, Any]:
    """Prefill in one process, decode in another; returns the decode engine's reply.
    ``readers``: the decode engine's TP ranks that each pull from the offer."""
    done = prefill("prefill", request_id=request_id, prompt=prompt, readers=readers)
    if flip:
        prefill("flip", request_id=request_id, block=len(done["block_ids"]) - 1)
    reply = decode(
        "decode",
        request_id=request_id,
        kv_transfer_params=done["kv_transfer_params"],
        first_token=done["first_token"],
        max_tokens=max_tokens,
    )
    released = prefill("finished")
    reply["release_reason"] = released["released"].get(request_id)
    reply["prefill_block_ids"] = done["block_ids"]
    return reply


def streamed_handoff(
    prefill: EngineProcess,
    decode: EngineProcess,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    said_early: bool = False,
) -> dict[str, Any]:
    """Push mode, layer-wise: the decode engine expects the transfer first (as a router would
    dispatch both at once), the prefill engine pushes its blocks before computing them and
    says each layer written as it finishes (``said_early``: all at once, before the model
    runs: the negative control); returns the decode engine's reply."""
    transfer_id = f"{request_id}-" + secrets.token_hex(16)
    expecting = decode("receive", request_id=request_id, transfer_id=transfer_id, num_tokens=len(prompt))
    done = prefill(
        "prefill_streamed",
        request_id=request_id,
        prompt=prompt,
        transfer_id=transfer_id,
        to=expecting["peer_address"],
        said_early=said_early,
    )
    reply = decode("decode_received", request_id=request_id, first_token=done["first_token"], max_tokens=max_tokens)
    reply.update(mode=done["mode"], release_reason=done["release_reason"])
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    model, _ = m.build_model()
    all_same = True
    with engines() as e:
        for i, length in enumerate(PROMPT_LENGTHS):
            prompt = m.prompt_tokens(i, length)
            expected = m.generate(model, prompt, args.max_tokens)
            paths = (("local", e.decode_local, 1), ("remote", e.decode_remote, 1), ("remote-tp2-HND", e.decode_tp2, 2))
            for path, decode, readers in paths:
                got = handoff(e.prefill, decode, f"req{i}-{path}", prompt, args.max_tokens, readers=readers)
                same = got["tokens"] == expected
                all_same &= same
                line = {"prompt_tokens": length, "path": path, "same_tokens": same, "tokens": got["tokens"]}
                print(json.dumps(line), flush=True)
    sys.exit(0 if all_same else 1)


if __name__ == "__main__":
    main()
