"""Tickets handed out before their offer is made: a scheduler answers at once (vLLM's
``request_finished``) and its worker offers a step later, under the id and token the ticket
already names. A pull that arrives first waits for the offer, boundedly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest

from bench.cluster import Cluster
from kvxfer.proto import engine_pb2
from kvxfer_client import (
    AlreadyExistsError,
    AsyncKvxferClient,
    HostBuffer,
    InvalidRequestError,
    Layout,
    NotFoundError,
)

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=16, block_bytes=4096)
WAIT_S = 2.0  # within half of the default peer_timeout_s (5 s), so used as given


@pytest.fixture(scope="module")
def daemons() -> Iterator[Cluster]:
    with Cluster() as c:
        c.daemon("a", "--offer-wait-s", str(WAIT_S))
        c.daemon("b", "--offer-wait-s", str(WAIT_S))
        yield c


async def _pool(client: AsyncKvxferClient, seed: int | None = None):  # type: ignore[no-untyped-def]
    buffers = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    if seed is not None:
        for i, b in enumerate(buffers):
            b.array()[:] = np.random.default_rng(seed + i).integers(0, 256, b.size, dtype=np.uint8)
    return await client.register_pool(buffers, LAYOUT), buffers


@pytest.mark.parametrize("path", ["local", "remote"])
async def test_a_pull_that_comes_first_waits_for_the_offer(daemons: Cluster, path: str) -> None:
    a, b = daemons.daemons
    async with (
        AsyncKvxferClient(a.socket, engine_name="p") as prefill,
        AsyncKvxferClient((a if path == "local" else b).socket, engine_name="d") as decode,
    ):
        (src, src_buf), (dst, dst_buf) = await _pool(prefill, seed=3), await _pool(decode)
        ticket = prefill.new_ticket(src, 3)  # no round trip: handed out at once
        assert ticket.peer_address == a.info["peer_address"]
        waits_before = a.log().count("offer.awaited")
        pull = asyncio.create_task(decode.pull(ticket, dst, [7, 8, 9]))
        started = time.monotonic()
        while a.log().count("offer.awaited") == waits_before:  # the offering daemon is waiting
            assert time.monotonic() - started < 10 and not pull.done(), a.log()[-2000:]
            await asyncio.sleep(0.02)
        made = await prefill.offer(src, [4, 1, 12], ticket=ticket)
        assert (made.offer_id, made.token) == (ticket.offer_id, ticket.token)
        result = await pull
        assert result.bytes == 3 * LAYOUT.bytes_per_block
        for s, d in zip([4, 1, 12], [7, 8, 9], strict=True):
            for r in LAYOUT.regions:
                got = dst_buf[r.buffer_index].array()[r.offset + d * r.block_stride :][: r.block_bytes]
                want = src_buf[r.buffer_index].array()[r.offset + s * r.block_stride :][: r.block_bytes]
                assert (got == want).all()


async def test_an_offer_never_made_is_not_found_after_the_wait(daemons: Cluster) -> None:
    a = daemons.daemons[0]
    async with AsyncKvxferClient(a.socket, engine_name="p") as prefill:
        src, _ = await _pool(prefill)
        dst, _ = await _pool(prefill)
        ticket = prefill.new_ticket(src, 1)
        started = time.monotonic()
        with pytest.raises(NotFoundError, match="no offer"):
            await prefill.pull(ticket, dst, [0])
        assert WAIT_S - 0.2 <= time.monotonic() - started < WAIT_S + 5


async def test_chosen_ids_are_checked_and_never_reused(daemons: Cluster) -> None:
    a = daemons.daemons[0]
    async with AsyncKvxferClient(a.socket, engine_name="p") as prefill:
        src, _ = await _pool(prefill)
        ticket = prefill.new_ticket(src, 2)
        await prefill.offer(src, [0, 1], ticket=ticket)
        with pytest.raises(AlreadyExistsError, match="is taken"):
            await prefill.offer(src, [2, 3], ticket=ticket)
        await prefill.release(ticket.offer_id)
        with pytest.raises(AlreadyExistsError, match="is taken"):  # nor after it ended
            await prefill.offer(src, [2, 3], ticket=ticket)
        for offer_id, token in [("off-short", bytes(16)), ("x" * 36, bytes(16)), (ticket.offer_id[:-1] + "0", b"1")]:
            req = engine_pb2.OfferRequest(
                pool_id=src.pool_id, block_ids=[5], session_id=prefill.session_id, offer_id=offer_id, token=token
            )
            with pytest.raises(InvalidRequestError, match="chosen offer needs"):
                await prefill._call(prefill._engine.Offer, req)
