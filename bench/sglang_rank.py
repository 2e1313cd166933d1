"""One SGLang rank (prefill or decode) on kvxfer's backend, driven over stdin by a test.

It builds what SGLang's scheduler builds for a PD rank, with SGLang's own classes: the
runtime context (``publish`` of its ``ServerArgs``), its plugins (kvxfer's registration, by
its entry point), a CPU ``MHATokenToKVPool`` (or a hybrid model's pools:
``bench.sglang_hybrid``) and ``MetadataBuffers``, the ``KVArgs`` its
bootstrap/prealloc queue fills, and the backend's manager from ``get_kv_class``. Then each
command drives a request's sender or receiver the way SGLang's queues do (see
``tests/sglang/in_engine``). The model runner is the test: the prefill rank writes a known
pattern for its heads into the request's pages; the decode rank checks its own heads.

Usage: ``python -m bench.sglang_rank ROLE TP RANK BOOTSTRAP_PORT MODEL_DIR [mha|swa|mamba]`` (``$KVXFER_SOCKET``:
its daemon). Commands and answers are JSON lines; answers start with ``@@``.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
import traceback
from typing import Any

import numpy as np

from bench.cluster import Daemon
from bench.sglang_hybrid import HybridState
from bench.sglang_proc import SglangProcess, serve

PAGE = 16
HEADS, HEAD_DIM, LAYERS = 4, 32, 2  # the test model: 4 KV heads of 32, two layers
POOL_TOKENS = 4096
SLOTS = 16


def write_model(directory: str) -> str:
    """The test model's config (SGLang reads its KV heads off it)."""
    from bench.vllm_engine import write_model as write

    return write(directory, num_attention_heads=8, num_key_value_heads=HEADS, head_dim=HEAD_DIM, hidden_size=256)


def pattern(room: int, tokens: int) -> np.ndarray[Any, Any]:
    """Every byte a request's KV holds, [layer, K/V, token, head, dim] in bfloat16 bits."""
    rng = np.random.default_rng(room)
    return rng.integers(0, 1 << 15, size=(LAYERS, 2, tokens, HEADS, HEAD_DIM), dtype=np.uint16)


class _OneStage:
    """A pipeline group of one stage (SGLang reads it off the parallel context)."""

    world_size, rank_in_group, is_first_rank, is_last_rank = 1, 0, True, True


class Rank:
    def __init__(self, role: str, tp: int, rank: int, port: int, model: str, kind: str = "mha") -> None:
        from sglang.srt.plugins import load_plugins

        load_plugins()  # kvxfer's entry point: "kvxfer" becomes a backend (import SGLang's names after it)
        import torch
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            get_kv_class,
            get_kv_transfer_buf_infos,
            get_pd_kv_layout,
            setup_state_kv_args,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
        from sglang.srt.server_args import ServerArgs

        self.role, self.tp, self.rank, self.port = role, tp, rank, port
        args = ServerArgs(
            model_path=model, disaggregation_mode=role, disaggregation_transfer_backend="kvxfer",
            tp_size=tp, device="cpu", disaggregation_bootstrap_port=port, page_size=PAGE,
        )  # fmt: skip
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
        # The pipeline group the scheduler builds with torch.distributed: one stage here.
        get_parallel().override_permanently(pp_group=_OneStage())
        backend = TransferBackend("kvxfer")
        self.kind = lambda name: get_kv_class(backend, getattr(KVClassType, name))
        if role == "prefill" and rank == 0:
            self.server = self.kind("BOOTSTRAP_SERVER")(host="127.0.0.1", port=port)
        self.heads = HEADS // tp
        self.hybrid = None
        if kind == "mha":
            self.pool = self.kv = MHATokenToKVPool(
                POOL_TOKENS, PAGE, torch.bfloat16, self.heads, HEAD_DIM, LAYERS, "cpu", False
            )
        else:
            heads = slice(rank * self.heads, (rank + 1) * self.heads)
            self.hybrid = HybridState(kind, (HEADS, heads), HEAD_DIM, PAGE)
            self.pool, self.kv = self.hybrid.pool, self.hybrid.full
        self.meta = MetadataBuffers(
            SLOTS, hidden_size=64, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=1
        )
        kv_args = KVArgs()
        kv_args.engine_rank, kv_args.pp_rank, kv_args.system_dp_rank = rank, 0, None
        kv_args.kv_cache_dtype_str = "bfloat16"
        kv_args.kv_layout = get_pd_kv_layout(self.pool)
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(self.pool)
        kv_args.num_draft_entries, kv_args.kv_layer_ids = 0, list(range(len(self.kv.k_buffer))) * 2
        kv_args.prefill_start_layer, kv_args.prefill_end_layer = 0, LAYERS
        if role == "prefill":  # the prefill queue states the heads; the decode queue leaves them out
            kv_args.kv_head_num, kv_args.total_kv_head_num = self.heads, HEADS
        kv_args.page_size = PAGE
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = self.meta.get_buf_infos()
        kv_args.ib_device, kv_args.gpu_id, kv_args.rust_http_port = None, 0, None
        req_to_token = getattr(self.hybrid, "req_to_token", None)
        setup_state_kv_args(kv_args, self.pool, None, total_kv_layers=LAYERS, req_to_token_pool=req_to_token)
        if self.hybrid is not None:
            self.hybrid.bind(kv_args)
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        self.mgr = self.kind("MANAGER")(kv_args, mode, args, False)
        self.free_pages = list(range(1, POOL_TOKENS // PAGE))  # page 0 is SGLang's padding page
        self.free_slots = list(range(SLOTS))
        self.reqs: dict[int, dict[str, Any]] = {}

    # -- both sides ------------------------------------------------------------------------
    def poll(self, rooms: list[int]) -> dict[str, int]:
        return {str(r): int(self.reqs[r]["side"].poll()) for r in rooms}

    def wait(self, rooms: list[int], timeout_s: float) -> dict[str, Any]:
        """Poll until every request ended (SGLang's inflight / transfer queues), then answer
        how each ended; the decode side checks the bytes of its successes."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        ends_at, out = time.monotonic() + timeout_s, {}
        left = list(rooms)
        while left and time.monotonic() < ends_at:
            for room in list(left):
                state = self.reqs[room]["side"].poll()
                if state in (KVPoll.Success, KVPoll.Failed):
                    out[str(room)] = self._finish(room, state == KVPoll.Success)
                    left.remove(room)
            time.sleep(0.005)
        for room in left:
            out[str(room)] = {"status": "timeout"}
        return out

    def _finish(self, room: int, ok: bool) -> dict[str, Any]:
        req = self.reqs.pop(room)
        side, answer = req["side"], {"status": "success" if ok else "failed"}
        if not ok:
            try:
                side.failure_exception()  # SGLang's way to the reason; it clears the request
            except Exception as exc:  # noqa: BLE001 - the reason is the answer
                answer["reason"] = str(exc)
        else:
            if self.role == "decode":
                answer.update(self._check(room, req))
            side.clear()
        self.free_pages.extend(req.get("pages", []))
        if self.hybrid is not None:
            self.hybrid.free.extend(req.get("rows", []))
        self.free_slots.append(req["slot"])
        return answer

    def abort(self, room: int) -> None:
        self.reqs[room]["side"].abort()

    def state(self) -> dict[str, Any]:
        client = self.mgr.client
        return {
            "rooms": sorted(int(r) for r in self.mgr.request_status),
            "free_pages": len(self.free_pages),
            "daemon": {
                "connected": client.connected,
                "peer_address": client.peer_address,
                "reconnects": client.reconnects,
            },
        }

    # -- prefill (PrefillBootstrapQueue, then the prefill batch and its inflight queue) -----
    def sender(self, room: int) -> None:
        side = self.kind("SENDER")(mgr=self.mgr, bootstrap_addr=f"127.0.0.1:{self.port}", bootstrap_room=room)
        self.reqs[room] = {"side": side, "slot": self.free_slots.pop()}

    def prefill(self, room: int, tokens: int, chunk_pages: int, chunks: int | None = None) -> None:
        """finalize_bootstrap, the forward pass (the pattern into fresh pages) and send_kv_chunk
        for each chunk (``chunks``: only the first so many now, the rest with ``send_rest``)."""
        req, side = self.reqs[room], self.reqs[room]["side"]
        prefix = side.pop_decode_prefix_len()
        count = -(-(tokens - prefix) // PAGE)
        side.init(count, req["slot"])
        pages = [self.free_pages.pop() for _ in range(count)]
        req["pages"] = pages
        self._write(room, tokens, prefix, pages)
        self.meta.output_ids[req["slot"]][0] = room % 1000
        self.meta.bootstrap_room[req["slot"]][0] = room
        state = self._state_rows(room, count, write=True)
        req["chunks"] = [
            (pages[start : start + chunk_pages], state if start + chunk_pages >= count else None)
            for start in range(0, count, chunk_pages)
        ]
        self.send_rest(room, chunks)

    def send_rest(self, room: int, chunks: int | None = None) -> None:
        """Send the request's next ``chunks`` chunks (all that are left: None)."""
        req = self.reqs[room]
        left = req["chunks"]
        now, req["chunks"] = left[:chunks], left[len(left[:chunks]) :]
        for pages, state in now:
            req["side"].send(np.asarray(pages, dtype=np.int32), state)

    def forge_chunk(self, room: int, start: int, count: int, own_nonce: bool) -> None:
        """A chunk message to each decode rank of the request, as a hostile peer sends one
        (under a nonce of its own making) or a broken prefill rank (the request's, out of order)."""
        from kvxfer_client.sglang._messages import Chunk

        for info in self.mgr.transfer_infos[room].values():
            nonce = info.nonce if own_nonce else secrets.token_hex(16)
            self.mgr.tell(info, Chunk(room, nonce, start, count).to_frames())

    def _state_rows(self, room: int, pages: int, write: bool = False) -> list[Any] | None:
        """A hybrid model's state rows for the request, as SGLang's payloads list them (the
        prefill rank writes its pattern into them)."""
        if self.hybrid is None:
            return None
        rows = self.reqs[room]["rows"] = self.hybrid.allocate(pages)
        if write:
            self.hybrid.write(room, rows)
        return [np.asarray(rows, dtype=np.int32)]

    def _write(self, room: int, tokens: int, prefix: int, pages: list[int]) -> None:
        import torch

        kv = pattern(room, tokens)[:, :, prefix:, self.rank * self.heads : (self.rank + 1) * self.heads]
        locs = np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in pages])[: tokens - prefix]
        for layer in range(len(self.kv.k_buffer)):
            for which, buffers in enumerate((self.kv.k_buffer, self.kv.v_buffer)):
                dst = buffers[layer].view(torch.int16)
                dst[torch.from_numpy(locs)] = torch.from_numpy(kv[layer, which].astype(np.int16))

    # -- decode (DecodePreallocQueue, then the DecodeTransferQueue) -------------------------
    def receiver(self, room: int) -> int:
        """The receiver, the prefill's parallel info, ``init``: returns its poll."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        addr = f"127.0.0.1:{self.port}"
        side = self.kind("RECEIVER")(mgr=self.mgr, bootstrap_addr=addr, bootstrap_room=room)
        self.reqs[room] = {"side": side, "slot": self.free_slots.pop()}
        ends_at = time.monotonic() + 30
        while not self.mgr.try_ensure_parallel_info(addr):
            if time.monotonic() > ends_at:
                side.abort()
                return int(KVPoll.Failed)
            time.sleep(0.1)
        side.init(0)
        return int(side.poll())

    def compares_checksums(self) -> bool:
        """Whether SGLang's KV checksum is compared for requests from this prefill."""
        return bool(self.mgr.should_verify_kv_checksum(f"127.0.0.1:{self.port}"))

    def allocate(self, room: int, tokens: int, prefix: int) -> None:
        """Pages for the request past its cached prefix, and ``send_metadata``."""
        req = self.reqs[room]
        count = -(-(tokens - prefix) // PAGE)
        req.update(pages=[self.free_pages.pop() for _ in range(count)], tokens=tokens, prefix=prefix)
        self.meta.bootstrap_room[req["slot"]][0] = 0
        state = self._state_rows(room, count)
        req["side"].send_metadata(
            np.asarray(req["pages"], dtype=np.int32), req["slot"], state, decode_prefix_len=prefix
        )

    def landed_pages(self, room: int) -> int:
        """How many of the request's first pages hold the prefill's bytes already (decode)."""
        want, got = self._kv(room, self.reqs[room])
        per_token = (want == got).all(axis=(0, 1, 3, 4))
        per_page = [bool(per_token[i : i + PAGE].all()) for i in range(0, len(per_token), PAGE)]
        return per_page.index(False) if False in per_page else len(per_page)

    def _kv(self, room: int, req: dict[str, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """What the request's KV past its prefix is on this rank's heads, and what this rank's
        pages hold: [layer, K/V, token, head, dim] each."""
        import torch

        tokens, prefix, pages = req["tokens"], req["prefix"], req["pages"]
        layers = len(self.kv.k_buffer)
        want = pattern(room, tokens)[:layers, :, prefix:, self.rank * self.heads : (self.rank + 1) * self.heads]
        locs = torch.from_numpy(np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in pages])[: tokens - prefix])
        got = [
            [b[layer].view(torch.int16)[locs].numpy() for b in (self.kv.k_buffer, self.kv.v_buffer)]
            for layer in range(layers)
        ]
        return want.astype(np.int16), np.asarray(got)

    def _check(self, room: int, req: dict[str, Any]) -> dict[str, Any]:
        want, got = self._kv(room, req)
        slot = req["slot"]
        meta_ok = int(self.meta.bootstrap_room[slot][0]) == room and int(self.meta.output_ids[slot][0]) == room % 1000
        answer = {"bad_elements": int((want != got).sum()), "elements": int(want.size), "metadata_ok": meta_ok}
        if self.hybrid is not None:
            answer["state_bad_elements"] = self.hybrid.bad_elements(room, req["rows"])
        return answer


def main() -> None:
    role, tp, rank, port, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    try:
        worker = Rank(role, tp, rank, port, model, *sys.argv[6:])
    except Exception as exc:  # noqa: BLE001 - the test shows why the rank did not start
        print("@@" + json.dumps({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}), flush=True)
        return
    serve(worker)


class SglangRank(SglangProcess):
    """One prefill or decode rank (:class:`Rank`) on ``daemon``: ``place`` is (TP size, rank)."""

    def __init__(
        self, role: str, place: tuple[int, int], port: int, model: str, daemon: Daemon, kind: str = "mha"
    ) -> None:
        tp, rank = place
        argv = [role, str(tp), str(rank), str(port), model, kind]
        super().__init__("bench.sglang_rank", argv, daemon, f"{role}{rank}")


if __name__ == "__main__":
    main()
