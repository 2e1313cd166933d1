"""The Hello's compatibility check: a mismatch is FAILED_PRECONDITION and names what differs."""

from __future__ import annotations

import grpc
import pytest

from kvxfer.proto import peer_pb2
from kvxfer_client import IncompatibleError
from kvxferd.peer.directory import check_compatible

#: Shaped like a UCX worker address (version byte, then payload); real ones are ~200 bytes.
WORKER = b"\x20" + bytes(range(1, 64))
OURS = peer_pb2.PeerIdentity(daemon_id="a", version="0.1.0", protocol_version=1, ucx_worker_address=WORKER)


def theirs(**changes: object) -> peer_pb2.PeerIdentity:
    msg = peer_pb2.PeerIdentity(daemon_id="b", version="0.1.0", protocol_version=1, ucx_worker_address=WORKER)
    for k, v in changes.items():
        setattr(msg, k, v)
    return msg


def test_a_compatible_peer_passes() -> None:
    check_compatible(OURS, theirs())


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            {"protocol_version": 2, "version": "0.9.0"},
            "speaks protocol 2, this daemon speaks 1 (versions 0.9.0 vs 0.1.0)",
        ),
        ({"daemon_id": "a"}, "equals ours"),
        ({"daemon_id": ""}, "is empty"),
        ({"ucx_worker_address": b""}, "has no UCX worker"),
        (
            {"ucx_worker_address": b"\x2b" + bytes(range(1, 64))},
            "malformed UCX worker address: unknown address version",
        ),
        ({"ucx_worker_address": b"\x20\x01"}, "malformed UCX worker address: 2 bytes"),
    ],
)
def test_an_incompatible_peer_is_refused_naming_the_mismatch(changes: dict[str, object], named: str) -> None:
    with pytest.raises(IncompatibleError, match=named.replace("(", r"\(").replace(")", r"\)")) as info:
        check_compatible(OURS, theirs(**changes))
    assert info.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
