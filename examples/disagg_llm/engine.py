"""One engine process (prefill or decode) of the example, driven by JSON lines on stdin.

It talks to its daemon only through ``kvxfer_client``'s public surface: a
:class:`~.connector.ConnectorScheduler` and :class:`~.connector.ConnectorWorker`, the way
an engine's KV-connector plugin would.

Run: ``python -m examples.disagg_llm.engine --role prefill --socket /run/kvxfer/kvxferd.sock``
then write ``{"op": "prefill", "request_id": "r1", "prompt": [1, 2, 3]}`` to its stdin.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from kvxfer_client import KvxferClient, KvxferError

from . import model as m
from .connector import TICKET_KEY, ConnectorScheduler, ConnectorWorker


class BlockAllocator:
    """Free block ids in a seeded random order, as a long-running engine's free list looks."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self._free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self._free)} free")
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def give_back(self, ids: list[int]) -> None:
        self._free.extend(ids)


class Engine:
    def __init__(self, role: str, socket: str, num_blocks: int, seed: int, tp: int = 1) -> None:
        self.role = role
        self.model, config = m.build_model()
        self.kv = m.KvPool.create(config, num_blocks)
        self.client = KvxferClient(socket, engine_name=f"example-{role}")
        self.pool = self.client.register_pool(self.kv.buffers, self.kv.layout(), name=f"{role}-kv")
        # A decode side of tensor-parallel size ``tp`` (> 1): one heads-major pool per rank,
        # each pulling its heads of the prefill's (tokens-major, all heads) blocks.
        self.ranks = [m.KvPool.create(config, num_blocks, tp, r, "HND") for r in range(tp)] if tp > 1 else []
        self.rank_pools = [self.client.register_pool(k.buffers, k.layout(), name=f"rank{k.rank}") for k in self.ranks]
        self.scheduler = ConnectorScheduler(self.client, self.pool, lease_s=60.0)
        #: (callback, request id) as the connector reported them, on the client's thread.
        self.callbacks: list[tuple[str, str]] = []
        self.worker = ConnectorWorker(
            self.client,
            self.pool,
            load_timeout_s=30.0,
            on_load_done=lambda rid, _result: self.callbacks.append(("load_done", rid)),
            on_load_failed=lambda rid, _error: self.callbacks.append(("load_failed", rid)),
            on_send_done=lambda rid, released: self.callbacks.append((f"send_done:{released.reason}", rid)),
        )
        self.blocks = BlockAllocator(num_blocks, seed)
        self.held: dict[str, list[int]] = {}  # request -> blocks kept until released
        #: Push mode, decode side: request -> (blocks, tokens, the receive under way).
        self.receiving: dict[str, tuple[list[int], int, Any]] = {}

    # -- prefill ------------------------------------------------------------------------
    def op_prefill(self, request_id: str, prompt: list[int], readers: int = 1) -> dict[str, Any]:
        cache, first = m.prefill(self.model, prompt)
        ids = self.blocks.take(m.blocks_for(len(prompt)))
        self.kv.write(cache, ids)
        delay_free, params = self.scheduler.request_finished(request_id, ids, len(prompt), readers)
        if delay_free:
            self.held[request_id] = ids
        self.worker.start_load_kv(self.scheduler.build_connector_meta())  # watches the offer
        return {"kv_transfer_params": params, "first_token": first, "block_ids": ids}

    def op_prefill_streamed(
        self, request_id: str, prompt: list[int], transfer_id: str, to: str, said_early: bool = False
    ) -> dict[str, Any]:
        """Push mode, layer by layer: the blocks are pushed under ``transfer_id`` to the decode
        daemon at ``to`` before the model runs; each layer's KV is stored as the layer finishes
        and said written, so the decode side receives it while the next layers compute.
        Returns once the offer is released (pulled, or why not). ``said_early``: every layer
        said written before the model runs (a bug this shows the tokens catch)."""
        ids = self.blocks.take(m.blocks_for(len(prompt)))
        layers = self.model.config.num_hidden_layers
        pushed = self.client.push(self.pool, ids, transfer_id, to, lease_s=60.0, layers=layers)
        if said_early:  # the negative control: "written" before the model has run
            self.client.layers_ready(pushed.ticket, layers)

        def after_layer(cache: Any, index: int) -> None:
            self.kv.write_layer(cache, index, ids)
            self.client.layers_ready(pushed.ticket, index + 1)

        try:
            first = m.prefill_by_layer(self.model, prompt, after_layer)
            released = self.client.wait_released(pushed.ticket.offer_id, 30.0)
        finally:
            self.blocks.give_back(ids)
        return {"first_token": first, "mode": pushed.mode, "release_reason": released.reason.value, "block_ids": ids}

    def op_receive(self, request_id: str, transfer_id: str, num_tokens: int) -> dict[str, Any]:
        """Expect a push of ``num_tokens`` tokens under ``transfer_id`` (answers at once)."""
        ids = self.blocks.take(m.blocks_for(num_tokens))
        self.receiving[request_id] = (ids, num_tokens, self.client.start_receive(transfer_id, self.pool, ids))
        return {"block_ids": ids, "peer_address": self.client.peer_address}

    def op_decode_received(self, request_id: str, first_token: int, max_tokens: int) -> dict[str, Any]:
        ids, num_tokens, receiving = self.receiving.pop(request_id)
        try:
            result = receiving.result(timeout=30)
            tokens = m.decode(self.model, self.kv.read(ids, num_tokens), first_token, max_tokens)
        finally:
            self.blocks.give_back(ids)
        return {"tokens": tokens, "transport": result.transport, "bytes": result.bytes}

    def op_flip(self, request_id: str, block: int) -> dict[str, Any]:
        """Negative control: corrupt one offered block's layer-0 K bytes before it is pulled."""
        raw = self.kv.layer(0)[0, self.held[request_id][block]].numpy().view(np.uint8)
        raw ^= 0x5A
        return {"flipped_bytes": int(raw.size)}

    def op_finished(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait until every offered request's blocks are released; free them."""
        reasons: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while self.held and time.monotonic() < deadline:
            sending, _ = self.worker.get_finished()
            for rid in sending:
                reasons[rid] = str(self.worker.release_reason(rid))
                self.blocks.give_back(self.held.pop(rid))
            time.sleep(0.01)
        return {"released": reasons, "still_held": sorted(self.held)}

    def op_callbacks(self, request_id: str) -> dict[str, Any]:
        """The connector callbacks seen so far for ``request_id``, in order."""
        return {"callbacks": [name for name, rid in list(self.callbacks) if rid == request_id]}

    # -- decode -------------------------------------------------------------------------
    def op_decode(
        self, request_id: str, kv_transfer_params: dict[str, Any], first_token: int, max_tokens: int
    ) -> dict[str, Any]:
        num_tokens = self.scheduler.get_num_new_matched_tokens(request_id, kv_transfer_params)
        ids = self.blocks.take(m.blocks_for(num_tokens))
        if self.ranks:
            return self._decode_by_ranks(ids, kv_transfer_params, num_tokens, first_token, max_tokens)
        try:
            self.scheduler.update_state_after_alloc(request_id, kv_transfer_params, ids)
            self.worker.start_load_kv(self.scheduler.build_connector_meta())
            self._wait_loaded(request_id, deadline_s=35.0)
            cache = self.kv.read(ids, num_tokens)
            tokens = m.decode(self.model, cache, first_token, max_tokens)
        finally:
            self.blocks.give_back(ids)
        return {"tokens": tokens, "block_ids": ids}

    def _decode_by_ranks(
        self, ids: list[int], params: dict[str, Any], num_tokens: int, first_token: int, max_tokens: int
    ) -> dict[str, Any]:
        """Each rank pulls its heads of the one ticket (the offer serves them all), then the
        model's cache is rebuilt from the ranks' pools."""
        try:
            ticket = params[TICKET_KEY]
            mappings = [self.client.pull(ticket, pool, ids, timeout_s=30).mapping for pool in self.rank_pools]
            tokens = m.decode(self.model, m.read_ranks(self.ranks, ids, num_tokens), first_token, max_tokens)
        finally:
            self.blocks.give_back(ids)
        return {"tokens": tokens, "block_ids": ids, "mappings": mappings}

    def _wait_loaded(self, request_id: str, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            _, recving = self.worker.get_finished()
            if request_id in recving:
                return
            failed = self.worker.get_failed()
            if request_id in failed:
                raise failed[request_id]
            time.sleep(0.001)
        raise TimeoutError(f"KV of {request_id} did not arrive in {deadline_s} s")

    def close(self) -> None:
        self.client.close()
        self.kv.close()
        for k in self.ranks:
            k.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1, help="decode: pull into this many heads-major rank pools")
    args = parser.parse_args()
    engine = Engine(args.role, args.socket, args.blocks, args.seed, args.tp)
    print(json.dumps({"ok": True, "ready": args.role}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "exit":
            break
        try:
            reply = {"ok": True, **getattr(engine, f"op_{op}")(**request)}
        except (KvxferError, RuntimeError, TimeoutError) as exc:
            reply = {"ok": False, "error": type(exc).__name__, "detail": str(exc)}
        print(json.dumps(reply), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
