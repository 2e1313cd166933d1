"""Staging memory is bounded and handed out whole."""

from __future__ import annotations

import asyncio

from kvxferd.dataplane.staging import StagingPool


async def test_a_transfer_waits_until_all_its_buffers_are_free() -> None:
    pool = StagingPool(total_bytes=4 * 4096, buffer_bytes=4096)
    order: list[str] = []

    async def user(name: str, count: int, hold_s: float) -> None:
        async with pool.lease(count) as lease:
            order.append(f"{name}+{len(lease.buffers)}")
            await asyncio.sleep(hold_s)
        order.append(f"{name}-")

    first = asyncio.create_task(user("a", 3, 0.05))
    await asyncio.sleep(0.01)
    await asyncio.gather(first, user("b", 2, 0))
    assert order == ["a+3", "a-", "b+2", "b-"]
    assert pool.in_use == 0


async def test_poisoned_buffers_are_replaced_not_reused() -> None:
    pool = StagingPool(total_bytes=2 * 4096, buffer_bytes=4096)
    async with pool.lease(2) as lease:
        old = [id(b) for b in lease.buffers]
        lease.poisoned = True
    async with pool.lease(2) as lease:
        assert not set(old) & {id(b) for b in lease.buffers}
    assert pool.replaced == 2 and pool.in_use == 0


async def test_buffers_are_made_on_first_need_and_reused() -> None:
    pool = StagingPool(total_bytes=3 * 4096, buffer_bytes=4096)
    assert pool.in_use == 0
    async with pool.lease(2) as lease:
        first = {id(b) for b in lease.buffers}
        assert pool.in_use == 2
    async with pool.lease(2) as lease:
        assert {id(b) for b in lease.buffers} == first
