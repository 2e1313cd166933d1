"""The connector's scheduler side: what it plans from kv_transfer_params (no daemon needed)."""

from __future__ import annotations

import pytest

from examples.disagg_llm.connector import ConnectorScheduler
from kvxfer_client import InvalidRequestError, Ticket

TICKET = Ticket("d", "127.0.0.1:1", "offer-1", b"\x01" * 16, 3, "f" * 16, 3 * 4096)


def scheduler() -> ConnectorScheduler:
    return ConnectorScheduler(client=None, pool="pool-1")  # type: ignore[arg-type]  # decode side only


def params(num_tokens: object = 40) -> dict[str, object]:
    return {"do_remote_prefill": True, "num_tokens": num_tokens, "kvxfer_ticket": TICKET.to_dict()}


def test_a_request_without_a_ticket_matches_no_tokens_and_plans_no_load() -> None:
    s = scheduler()
    assert s.get_num_new_matched_tokens("r", None) == 0
    assert s.get_num_new_matched_tokens("r", {"other": 1}) == 0
    s.update_state_after_alloc("r", None, [1, 2])
    assert s.build_connector_meta().loads == ()


def test_matched_tokens_exclude_what_the_engine_already_computed() -> None:
    assert scheduler().get_num_new_matched_tokens("r", params(40), num_computed_tokens=16) == 24


@pytest.mark.parametrize("bad", [-1, "40", 2.5, True, None])
def test_malformed_num_tokens_is_rejected(bad: object) -> None:
    with pytest.raises(InvalidRequestError, match="num_tokens"):
        scheduler().get_num_new_matched_tokens("r", params(bad))


def test_the_load_takes_the_first_ticket_blocks_of_the_allocation_and_meta_is_drained() -> None:
    s = scheduler()
    s.update_state_after_alloc("r", params(), [9, 4, 7, 1])
    meta = s.build_connector_meta()
    assert [(x.request_id, x.block_ids, x.ticket) for x in meta.loads] == [("r", (9, 4, 7), TICKET)]
    assert s.build_connector_meta().loads == ()


def test_too_few_allocated_blocks_is_an_error_naming_both_counts() -> None:
    with pytest.raises(InvalidRequestError, match="2 blocks allocated, the ticket holds 3"):
        scheduler().update_state_after_alloc("r", params(), [1, 2])


def test_a_malformed_ticket_is_rejected_before_any_pull() -> None:
    p = params()
    p["kvxfer_ticket"] = {"v": 1, "offer_id": "x"}
    with pytest.raises(InvalidRequestError):
        scheduler().update_state_after_alloc("r", p, [1, 2, 3])
