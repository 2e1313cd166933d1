"""The classes SGLang asks ``get_kv_class`` for under ``kvxfer``: manager, sender, receiver and
bootstrap server, on SGLang's own common implementations.

SGLang's ``common`` classes keep what every backend shares: the prefill bootstrap server the
decode side asks for the prefill ranks, the rank mapping between the two sides' parallelism,
the ZMQ control socket of each rank, request states, heartbeats, timeouts and aborts. What
is kvxfer's is how the bytes move: the manager registers the rank's KV pages and metadata
rows with the node's daemon (``$KVXFER_SOCKET``) as two pools, the decode side expects
pushes into the pages it allocated (:mod:`._decode`), the prefill side pushes them chunk by
chunk as it prefills them (:mod:`._prefill`), and both daemons do the rest.

A hybrid model's state components are pools of their own (:mod:`._state`) and ride with the
request's last chunk, as SGLang hands them over.

What this release does not move is refused where SGLang builds the manager, with the
reason: GPU pools (not built yet: no device to test on), MLA models, state kinds that are
not whole rows (``dsa_tail``), pipeline parallelism, and SGLang's staging and
host-destination modes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress

from kvxfer.errors import IncompatibleError, KvxferError
from kvxfer.layout import ModelInfo

from .._blocking import KvxferClient
from .._results import Pool
from ._decode import DecodeReceives
from ._memory import KV_FORMAT, host_views, kv_layout, row_layout
from ._messages import CHUNK_TAG, Registration, RoomInfo, parse_chunk
from ._prefill import PrefillPushes
from ._state import StateComponent, rows_of, state_kinds, state_layouts

__all__ = ["KvxferKVBootstrapServer", "KvxferKVManager", "KvxferKVReceiver", "KvxferKVSender"]

logger = logging.getLogger("kvxfer_client.sglang")


class KvxferKVManager(CommonKVManager):
    """One rank's kvxfer session, its two pools, and the thread reading its control socket."""

    # Status messages say why a request failed (SGLang's tagged layout).
    kv_status_msg_tag = b"KVXFER_STATUS"
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        _refuse_unsupported(args, server_args, bool(is_mla_backend))
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        #: This rank's ZMQ control endpoint, as the prefill side names decode ranks.
        self.session = f"{self.local_ip}:{self.rank_port}"
        #: Offers' lease (0: the daemon's default), seconds.
        self.lease_s = 0.0
        self.client = KvxferClient(engine_name=f"sglang-{role}-tp{self.attn_tp_rank}", auto_reconnect=True)
        self.kv_pool, self.aux_pool, self.states = self._register_pools(args, server_args, role)
        self._stopped = False
        if role == "prefill":
            self.pushes = PrefillPushes(self)
            self._start(self.pushes.on_message, "kvxfer-prefill")
        else:
            self.receives = DecodeReceives(self)
            self._start(self._on_status, "kvxfer-decode")
            self._start_heartbeat_checker_thread()
        logger.info(
            "kvxfer: %s rank %d of %d on daemon %s (KV pool %s, %d pages; metadata pool %s; state %s)",
            role, self.attn_tp_rank, self.attn_tp_size, self.client.daemon_id, self.kv_pool.pool_id,
            self.kv_pool.layout.num_blocks, self.aux_pool.pool_id, [s.kind for s in self.states] or "none",
        )  # fmt: skip

    def _register_pools(self, args: KVArgs, server_args: Any, role: str) -> tuple[Pool, Pool, list[StateComponent]]:
        """The KV pages, the metadata rows and each state component, a pool each."""
        total_heads = getattr(args, "total_kv_head_num", None) or _total_kv_heads(server_args)
        model = ModelInfo(
            dtype=args.kv_cache_dtype_str, block_tokens=args.page_size, tp_size=self.attn_tp_size,
            tp_rank=self.attn_tp_rank, kv_format=KV_FORMAT,
        )  # fmt: skip
        states = state_layouts(args, model, total_heads)
        register, name = self.client.register_pool, f"sglang-{role}-tp{self.attn_tp_rank}"
        kv = kv_layout(args.kv_item_lens, args.kv_data_lens, model, total_heads)
        kv_pool = register(host_views(args.kv_data_ptrs, args.kv_data_lens), kv, name=name)
        aux = row_layout(args.aux_item_lens, args.aux_data_lens, ModelInfo(kv_format="sglang-metadata"))
        aux_pool = register(host_views(args.aux_data_ptrs, args.aux_data_lens), aux, name=name + "-meta")
        components = [
            StateComponent(kind, register(host_views(args.state_data_ptrs[i], args.state_data_lens[i]), layout,
                                          name=f"{name}-{kind}"))
            for i, (kind, layout) in enumerate(states)
        ]  # fmt: skip
        return kv_pool, aux_pool, components

    def _start(self, handle: Callable[[list[bytes]], None], name: str) -> None:
        recv = self._make_worker_recv(self.server_socket)

        def loop() -> None:
            while not self._stopped:
                frames = recv()
                if frames is not None:
                    handle(frames)

        threading.Thread(target=loop, name=name, daemon=True).start()

    def _on_status(self, frames: list[bytes]) -> None:
        """A prefill rank's word on a request (decode side): a chunk it pushes, or its status.
        Success is this side's own to decide (its receives); a failure ends the request at once."""
        if frames and frames[0] == CHUNK_TAG:
            try:
                self.receives.expect_chunk(parse_chunk(frames))
            except (KvxferError, ValueError) as exc:
                logger.warning("kvxfer: dropped a malformed chunk message from a prefill rank: %s", exc)
            return
        parsed = self.parse_kv_status_message(frames)
        if parsed is None:
            return
        room, status, _rank, reason = parsed
        if status == KVPoll.Failed:
            self.receives.fail(room, reason or self.DEFAULT_PREFILL_FAILURE_REASON)

    def tell(self, info: RoomInfo, frames: list[bytes]) -> None:
        """A message to the decode rank of ``info`` over SGLang's control socket, as SGLang
        sends its status messages (prefill side). A send that fails fails the request: that
        rank would never expect the push the message announces."""
        address = NetworkAddress(info.endpoint, info.dst_port)
        try:
            self._send_multipart_locked(address.to_tcp(), frames, is_ipv6=address.is_ipv6)
        except Exception as exc:  # noqa: BLE001 - ZMQ's errors: the request cannot go on
            self.pushes.abort(info.room, f"telling decode rank {info.session} of a push failed: {exc}")

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """SGLang's KV checksum (``--disaggregation-enable-kv-checksum``) rides in the metadata
        row and the decode side compares it with its own digest; that is only meaningful where
        both sides hold the same heads. Where the prefill's TP differs, each decode rank holds
        a slice of what was digested: SGLang skips the comparison, and the daemon's block
        checksums (its ``integrity`` setting) check every landed page instead."""
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is None or int(info.attn_tp_size) == int(self.attn_tp_size)

    def build_receiver_registration_message(self) -> list[bytes]:
        client = self.client
        return Registration(
            self.session, client.peer_address, client.daemon_id, self.attn_tp_size, self.attn_tp_rank
        ).to_frames()

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        **more: Any,
    ) -> None:
        """A chunk of a request's prefilled pages (SGLang's ``send`` of a sender); the last
        one comes with the request's metadata row and state rows."""
        states = rows_of(more.get("state_indices"), len(self.states)) if is_last_chunk else []
        self.pushes.add(bootstrap_room, kv_indices, is_last_chunk, aux_index, states)

    def teardown(self) -> None:
        self._stopped = True
        self.client.close()


class KvxferKVSender(CommonKVSender):
    """SGLang's sender; an abort also withdraws what the request has on offer."""

    def __init__(
        self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int, *args: Any, **kwargs: Any
    ) -> None:
        mgr.pushes.senders.add(bootstrap_room)
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)

    def abort(self) -> None:
        self.kv_mgr.pushes.abort(self.bootstrap_room, "the prefill side aborted the request", tell_decode=True)
        super().abort()

    def clear(self) -> None:
        if self.kv_mgr.request_status.get(self.bootstrap_room) != KVPoll.Success:
            self.kv_mgr.pushes.abort(self.bootstrap_room, "the request was cleared before its transfer ended")
        self.kv_mgr.pushes.senders.discard(self.bootstrap_room)
        super().clear()


class KvxferKVReceiver(CommonKVReceiver):
    """SGLang's receiver; ``send_metadata`` expects the pushes before it names the pages."""

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        **more: Any,
    ) -> None:
        mgr, room = self.kv_mgr, self.bootstrap_room
        why = None
        if self.bootstrap_infos is None:
            why = f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}"
        elif aux_index is None:
            why = "the request has no metadata row"
        dst_states = rows_of(state_indices, len(mgr.states))
        why = why or self._unmovable_state(dst_states)
        if why is not None or aux_index is None:
            mgr.record_failure(room, why)
            mgr.update_status(room, KVPoll.Failed)
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        request = RoomInfo(
            room, mgr.session, self.required_dst_info_num, "", aux_index, False, decode_prefix_len or 0, pages,
            mgr.client.peer_address, tuple(dst_states),
        )  # fmt: skip
        infos = mgr.receives.expect(request, len(self.bootstrap_infos))
        for bootstrap_info, info in zip(self.bootstrap_infos, infos, strict=True):
            if not self._send_bootstrap_message(
                bootstrap_info=bootstrap_info, message=info.to_frames(), operation="send_metadata"
            ):
                mgr.receives.cancel(room)
                self.invalidate_cached_bootstrap_infos()
                return
        self.init_time = time.time()

    def _unmovable_state(self, dst_states: list[Any]) -> str | None:
        """Why the request's state cannot come from this prefill (None: it can): state moved
        row for row needs ranks that hold the same shard of it."""
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        prefill_tp = int(info.attn_tp_size) if info is not None else self.kv_mgr.attn_tp_size
        for state, rows in zip(self.kv_mgr.states, dst_states, strict=True):
            if len(rows) and not state.mappable and prefill_tp != self.kv_mgr.attn_tp_size:
                return (
                    f"SGLang's {state.kind!r} state moves between ranks of equal attention TP only "
                    f"(prefill TP {prefill_tp}, decode TP {self.kv_mgr.attn_tp_size}): run both with the same --tp-size"
                )
        return None

    def build_receiver_metadata_message(self, **_: Any) -> list[bytes]:
        raise NotImplementedError("kvxfer builds its metadata in send_metadata")

    def poll(self) -> Any:
        status = super().poll()
        if status == KVPoll.Failed:
            # Whatever ended it (a receive, a lost heartbeat, a timeout): stop the receives
            # and tell the prefill ranks, which withdraw their offers at once.
            self.kv_mgr.receives.cancel(self.bootstrap_room)
            self.ensure_abort_notified()
        return status

    def abort(self) -> None:
        super().abort()
        self.kv_mgr.receives.cancel(self.bootstrap_room)

    def clear(self) -> None:
        self.kv_mgr.receives.cancel(self.bootstrap_room)
        super().clear()


class KvxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap server: the decode side finds the prefill ranks there."""


def _refuse_unsupported(args: KVArgs, server_args: Any, is_mla: bool) -> None:
    device = str(getattr(server_args, "device", "cpu") or "cpu")
    refusals = {
        f"device {device!r}: kvxfer's SGLang backend moves CPU KV pools in this release (--device cpu)": device
        != "cpu",
        "MLA models: kvxfer's SGLang backend moves MHA KV pools in this release": is_mla,
        "pipeline parallelism (--pp-size > 1) is not supported by kvxfer's SGLang backend": getattr(
            server_args, "pp_size", 1
        )
        > 1,
    }
    for why, refused in refusals.items():
        if refused:
            raise IncompatibleError(why)
    state_kinds(args)  # a state kind it cannot move


def _total_kv_heads(server_args: Any) -> int:
    """The model's KV heads before any split (SGLang's decode side leaves them out of KVArgs)."""
    from sglang.srt.configs.model_config import ModelConfig

    return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())
