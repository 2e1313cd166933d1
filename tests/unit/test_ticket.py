"""Tickets are plain JSON and reject anything malformed."""

from __future__ import annotations

import json

import pytest

from kvxfer_client import InvalidRequestError, Ticket

GOOD = Ticket("daemon-a", "127.0.0.1:7461", "off-1", bytes(range(16)), 128, "f" * 32, 256 << 20)


def test_round_trips_through_json_and_proto() -> None:
    assert Ticket.from_json(GOOD.to_json()) == GOOD
    assert Ticket.from_dict(json.loads(json.dumps(GOOD.to_dict()))) == GOOD
    assert Ticket.from_proto(GOOD.to_proto()) == GOOD


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("token"), "malformed"),
        (lambda d: d.update(token="00"), "128 bits"),
        (lambda d: d.update(token="zz" * 16), "malformed"),
        (lambda d: d.update(v=99), "version"),
        (lambda d: d.update(num_blocks=0), "positive"),
        (lambda d: d.update(num_blocks=True), "positive"),
        (lambda d: d.update(offer_id=""), "non-empty"),
        (lambda d: d.update(peer_address=["x"]), "non-empty"),
    ],
)
def test_malformed_tickets_are_refused(mutate, message) -> None:  # type: ignore[no-untyped-def]
    data = GOOD.to_dict()
    mutate(data)
    with pytest.raises(InvalidRequestError, match=message):
        Ticket.from_dict(data)


def test_non_json_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="not JSON"):
        Ticket.from_json("{nope")
    with pytest.raises(InvalidRequestError, match="JSON object"):
        Ticket.from_json("[1, 2]")
