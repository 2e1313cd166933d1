"""Registry records and settings, as a hostile etcd writer or a careless operator gives them."""

from __future__ import annotations

import json

import pytest

from kvxfer.errors import InvalidRequestError
from kvxfer.fleet import FleetRecord, RegistryUrl, check_advertised
from kvxferd._config import load_settings

GOOD = {
    "v": 1,
    "daemon_id": "n1",
    "peer_address": "10.0.0.1:7461",
    "admin_address": "",
    "version": "1",
    "protocol_version": 3,
    "hostname": "h",
    "started_at": 1.5,
}


def test_a_record_round_trips_and_keeps_its_lists() -> None:
    r = FleetRecord("n1", "10.0.0.1:7461", "", "1", 3, "h", 1.0, 42, ("tcp",), ("host",), 5, 6, ("push",))
    assert FleetRecord.from_json(r.to_json()) == r


@pytest.mark.parametrize(
    "change",
    [
        {"v": 2},
        {"daemon_id": ""},
        {"daemon_id": "a/b"},
        {"daemon_id": "x" * 300},
        {"peer_address": 7},
        {"protocol_version": -1},
        {"pid": True},
        {"started_at": "now"},
        {"transports": "tcp"},
        {"capabilities": ["x" * 65]},
        {"transports": ["t"] * 65},
    ],
)
def test_a_malformed_record_is_refused_typed(change: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        FleetRecord.from_json(json.dumps({**GOOD, **change}).encode())


@pytest.mark.parametrize(
    "raw", [b"", b"[]", b"not json", b"{" * 20000, json.dumps({**GOOD, "pad": "x" * 17000}).encode()]
)
def test_what_is_not_a_record_is_refused_typed(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        FleetRecord.from_json(raw)


def test_a_missing_field_is_refused_typed() -> None:
    with pytest.raises(InvalidRequestError, match="malformed"):
        FleetRecord.from_json(json.dumps({k: v for k, v in GOOD.items() if k != "hostname"}).encode())


@pytest.mark.parametrize("text", ["http://h:2379", "etcd://", "etcd://h", "etcd://h:0", "etcd://h:99999", "h:2379"])
def test_a_bad_registry_address_names_the_form(text: str) -> None:
    with pytest.raises(ValueError, match=r"etcd://|host:port|no endpoint"):
        RegistryUrl.parse(text)


def test_a_loopback_or_wildcard_address_is_refused_only_where_the_registry_spans_hosts() -> None:
    wide, local = RegistryUrl.parse("etcd://10.0.0.9:2379"), RegistryUrl.parse("etcd://localhost:2379")
    for address in ("127.0.0.1:7461", "0.0.0.0:7461", "[::]:7461", "localhost:7461", "[::1]:7461"):
        with pytest.raises(ValueError, match="not routable"):
            check_advertised(address, wide)
        check_advertised(address, local)
    check_advertised("10.0.0.5:7461", wide)


def test_the_settings_refuse_what_the_registry_cannot_use() -> None:
    with pytest.raises(ValueError, match="not routable"):
        load_settings(["--registry", "etcd://10.0.0.9:2379"], environ={})
    ok = load_settings(
        ["--registry", "etcd://10.0.0.9:2379", "--peer-listen", "0.0.0.0:7461", "--peer-advertise", "10.0.0.5:7461"],
        environ={},
    )
    assert (ok.cluster, ok.registry_ttl_s) == ("default", 10)
    with pytest.raises(ValueError, match="cluster name"):
        load_settings(["--registry", "etcd://127.0.0.1:2379", "--cluster", "a/b"], environ={})
    with pytest.raises(ValueError, match="registry_ttl_s"):
        load_settings(["--registry", "etcd://127.0.0.1:2379", "--registry-ttl-s", "1"], environ={})
    with pytest.raises(ValueError, match="no '/'"):
        load_settings(["--registry", "etcd://127.0.0.1:2379", "--daemon-id", "a/b"], environ={})
    assert load_settings(environ={"KVXFERD_REGISTRY": "etcd://127.0.0.1:2379"}).registry
