"""``bench.grpc_floor``: a handoff's control messages on grpc.aio with no work behind them."""

from __future__ import annotations

from bench.grpc_floor import run


def test_the_grpc_floor_times_a_remote_handoffs_extra_round_trip_above_a_local_one() -> None:
    """``bench.grpc_floor``'s processes carry every message: a remote pull's peer round trip
    makes it cost more than a local one, and every figure is a real time."""
    floor = run(rounds=30)
    assert floor["figure"] == "floor"
    assert 0 < floor["local_p50_ms"] < floor["remote_p50_ms"]
    assert floor["echo2_p50_ms"] > 0
    assert floor["remote_vs_echo2"] == floor["remote_p50_ms"] / floor["echo2_p50_ms"]
