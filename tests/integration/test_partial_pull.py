"""Pulling part of a ticket: a decode engine whose prefix cache already holds the first blocks
pulls only the rest (``offer_block_indices``), locally and between daemons."""

from __future__ import annotations

import numpy as np
import pytest

from bench.cluster import Cluster
from kvxfer_client import AlreadyExistsError, AsyncKvxferClient, HostBuffer, InvalidRequestError, Layout

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=16, block_bytes=3000)


async def _pools(prefill: AsyncKvxferClient, decode: AsyncKvxferClient):  # type: ignore[no-untyped-def]
    src_buffers = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    for i, b in enumerate(src_buffers):
        b.array()[:] = np.random.default_rng(i).integers(0, 256, b.size, dtype=np.uint8)
    dst_buffers = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    src = await prefill.register_pool(src_buffers, LAYOUT)
    dst = await decode.register_pool(dst_buffers, LAYOUT)
    return src, dst, src_buffers, dst_buffers


def _block(buffers: list[HostBuffer], b: int) -> bytes:
    return b"".join(
        buffers[r.buffer_index].array()[r.offset + b * r.block_stride :][: r.block_bytes].tobytes()
        for r in LAYOUT.regions
    )


@pytest.mark.parametrize("path", ["local", "remote"])
async def test_only_the_blocks_asked_for_move_and_the_offer_is_pulled(two_daemons: Cluster, path: str) -> None:
    a, b = two_daemons.daemons
    async with (
        AsyncKvxferClient(a.socket, engine_name="p") as prefill,
        AsyncKvxferClient((a if path == "local" else b).socket, engine_name="d") as decode,
    ):
        src, dst, src_buf, dst_buf = await _pools(prefill, decode)
        offered = [9, 2, 14, 5, 0, 11, 7, 3]  # the request's blocks, in token order
        ticket = await prefill.offer(src, offered)
        cached = 3  # the decode engine's prefix cache holds the first three
        dst_ids = [12, 1, 6, 8, 15]
        result = await decode.pull(ticket, dst, dst_ids, offer_block_indices=range(cached, len(offered)))
        assert result.bytes == 5 * LAYOUT.bytes_per_block
        for k, d in enumerate(dst_ids):
            assert _block(dst_buf, d) == _block(src_buf, offered[cached + k])
        untouched = set(range(16)) - set(dst_ids)
        assert all(_block(dst_buf, d) == bytes(LAYOUT.bytes_per_block) for d in untouched)
        released = await prefill.wait_released(ticket.offer_id, timeout_s=10)
        assert released.reason.value == "pulled"


@pytest.mark.parametrize("path", ["local", "remote"])
async def test_bad_positions_are_refused_and_the_offer_stays_pullable(two_daemons: Cluster, path: str) -> None:
    a, b = two_daemons.daemons
    async with (
        AsyncKvxferClient(a.socket, engine_name="p") as prefill,
        AsyncKvxferClient((a if path == "local" else b).socket, engine_name="d") as decode,
    ):
        src, dst, _, _ = await _pools(prefill, decode)
        ticket = await prefill.offer(src, [1, 2, 3, 4])
        with pytest.raises(InvalidRequestError, match="reach 4; the ticket holds 4"):
            await decode.pull(ticket, dst, [0], offer_block_indices=[4])
        with pytest.raises(InvalidRequestError, match="repeat"):
            await decode.pull(ticket, dst, [0, 1], offer_block_indices=[2, 2])
        with pytest.raises(InvalidRequestError, match="2 of the ticket's blocks, 3 destination ids"):
            await decode.pull(ticket, dst, [0, 1, 5], offer_block_indices=[2, 3])
        result = await decode.pull(ticket, dst, [0, 1], offer_block_indices=[2, 3], transfer_id="part-1")
        assert result.bytes == 2 * LAYOUT.bytes_per_block
        again = await decode.pull(ticket, dst, [0, 1], offer_block_indices=[2, 3], transfer_id="part-1")
        assert again.transfer_id == "part-1"  # a retry is answered from the record
        with pytest.raises(AlreadyExistsError):
            await decode.pull(ticket, dst, [0, 1], offer_block_indices=[1, 3], transfer_id="part-1")
