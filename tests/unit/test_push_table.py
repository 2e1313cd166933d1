"""The push table alone (kvxferd.handoff.push.PushTable): which announcement meets which
expectation, and the bounds a hostile peer or engine meets."""

from __future__ import annotations

import asyncio

import pytest

from kvxfer_client import (
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from kvxferd.handoff.push import PushTable


async def test_a_held_announcement_meets_a_later_expectation_at_once() -> None:
    table = PushTable()
    assert table.announce("t", "ticket", lease_s=30, from_daemon_id="p") is False
    assert table.held == 1
    got = await table.wait("t", "s", "", timeout_s=0.01)
    assert (got.ticket, got.from_daemon_id, table.held) == ("ticket", "p", 0)


async def test_a_squatter_cannot_take_or_block_a_transfer_the_engine_expects_from_a_named_daemon() -> None:
    table = PushTable()
    table.announce("t", "forged", lease_s=30, from_daemon_id="squatter")  # came first
    waiting = asyncio.ensure_future(table.wait("t", "s", "prefill-0", timeout_s=5))
    await asyncio.sleep(0)
    assert not waiting.done(), "the squatter's announcement was taken"
    with pytest.raises(PermissionDeniedError, match="expects a push from prefill-0, not squatter2"):
        table.announce("t", "forged", lease_s=30, from_daemon_id="squatter2")
    assert table.announce("t", "real", lease_s=30, from_daemon_id="prefill-0") is True
    assert (await waiting).ticket == "real"


async def test_duplicates_and_bounds_are_refused_typed() -> None:
    table = PushTable(max_waiting=2)
    table.announce("t1", "x", lease_s=30, from_daemon_id="p")
    with pytest.raises(AlreadyExistsError):
        table.announce("t1", "x", lease_s=30, from_daemon_id="p")
    table.announce("t2", "x", lease_s=30, from_daemon_id="p")
    with pytest.raises(ResourceExhaustedError):
        table.announce("t3", "x", lease_s=30, from_daemon_id="p")
    waits = [asyncio.ensure_future(table.wait(t, "s", "", timeout_s=5)) for t in ("u1", "u2")]
    await asyncio.sleep(0)
    with pytest.raises(AlreadyExistsError):
        await table.wait("u1", "s", "", timeout_s=5)
    with pytest.raises(ResourceExhaustedError):
        await table.wait("u3", "s", "", timeout_s=5)
    for w in waits:
        w.cancel()
    await asyncio.gather(*waits, return_exceptions=True)


async def test_an_announcement_is_forgotten_at_its_lease_and_an_expectation_at_its_deadline() -> None:
    table = PushTable()
    table.announce("t", "x", lease_s=0.01, from_daemon_id="p")
    await asyncio.sleep(0.05)
    assert table.held == 0
    with pytest.raises(DeadlineExceededError, match=r"no push for transfer t came within 0\.01s"):
        await table.wait("t", "s", "", timeout_s=0.01)
    assert table.cancel("t", None) is False  # nothing waits any more


async def test_only_the_expecting_session_or_an_operator_cancels_a_wait() -> None:
    table = PushTable()
    waiting = asyncio.ensure_future(table.wait("t", "mine", "", timeout_s=5))
    await asyncio.sleep(0)
    with pytest.raises(PermissionDeniedError):
        table.cancel("t", "theirs")
    assert table.cancel("t", None) is True
    with pytest.raises(CancelledError, match="receive of transfer t was cancelled"):
        await waiting
