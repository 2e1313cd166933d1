"""The fleet registry's shared facts: where it is (``etcd://`` addresses), how its keys are
named, and what one daemon's record says. The daemon writes records (``kvxferd.fleet``);
``kvxferctl fleet`` reads them. Both reach etcd through :func:`etcd_client`.

Keys: one per daemon, ``/kvxfer/<cluster>/daemons/<daemon_id>``, its value a JSON
:class:`FleetRecord`, attached to the daemon's own etcd lease (it vanishes when the daemon
stops keeping the lease alive).

>>> url = RegistryUrl.parse("etcd://10.0.0.1:2379,10.0.0.2:2379")
>>> url.endpoints, url.tls, url.spans_hosts
(('10.0.0.1:2379', '10.0.0.2:2379'), False, True)
>>> RegistryUrl.parse("etcd://127.0.0.1:2379").spans_hosts
False
>>> record_key("prod", "kvxferd-n1")
b'/kvxfer/prod/daemons/kvxferd-n1'
>>> r = FleetRecord("n1", "10.0.0.5:7461", "10.0.0.5:7462", "1.0", 3, "n1.example", 1.0e9)
>>> FleetRecord.from_json(r.to_json()) == r
True

A record is only a hint: whoever reads one still asks the daemon at that address who it is
(the peer Hello, and its certificate where mTLS is on) before trusting it with anything. And
anyone with write access to etcd may have written it, so :func:`accepted` holds every record
read (listed or watched, by a daemon or by ``kvxferctl fleet``) to what a daemon writes: its
own key, a lease, a bounded size. :func:`list_records` lists in pages, so large records
under the prefix cannot make the listing too big to receive.

>>> prefix = cluster_prefix("prod")
>>> accepted("prod", prefix + b"n1", r.to_json(), lease=7).peer_address
'10.0.0.5:7461'
>>> accepted("prod", prefix + b"n2", r.to_json(), lease=7)
Traceback (most recent call last):
...
kvxfer_client.InvalidRequestError: the record under key 'n2' claims daemon id 'n1'
>>> accepted("prod", prefix + b"n1", r.to_json(), lease=0)
Traceback (most recent call last):
...
kvxfer_client.InvalidRequestError: the record of 'n1' has no lease: it would outlive any daemon, so no daemon wrote it
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvalidRequestError
from .tls import TlsFiles

if TYPE_CHECKING:
    from etcd3aio import Etcd3Client

__all__ = [
    "KEY_ROOT",
    "FleetRecord",
    "Listed",
    "RegistryUrl",
    "accepted",
    "check_advertised",
    "check_cluster_name",
    "cluster_prefix",
    "etcd_client",
    "list_records",
    "record_key",
]

KEY_ROOT = "/kvxfer"
RECORD_VERSION = 1
#: A record larger than this is not ours (a daemon's is well under 2 KiB).
MAX_RECORD_BYTES = 16 << 10
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_MAX_ID = 256


def check_cluster_name(name: str) -> str:
    """A cluster name that is safe as one key segment (ValueError otherwise)."""
    if not _NAME.match(name):
        raise ValueError(f"cluster name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return name


def cluster_prefix(cluster: str) -> bytes:
    return f"{KEY_ROOT}/{cluster}/daemons/".encode()


def record_key(cluster: str, daemon_id: str) -> bytes:
    return cluster_prefix(cluster) + daemon_id.encode()


def accepted(cluster: str, key: bytes, value: bytes, lease: int) -> FleetRecord:
    """The record stored under ``key`` on etcd lease ``lease`` (0: none), if a daemon could have
    written it: a record of this version, under the key of its own daemon id, on a lease.
    InvalidRequestError names what is wrong."""
    key_id = key[len(cluster_prefix(cluster)) :].decode(errors="replace")
    record = FleetRecord.from_json(value)
    if record.daemon_id != key_id:
        raise InvalidRequestError(f"the record under key {key_id[:100]!r} claims daemon id {record.daemon_id[:100]!r}")
    if not lease:
        raise InvalidRequestError(
            f"the record of {key_id[:100]!r} has no lease: it would outlive any daemon, so no daemon wrote it"
        )
    return record


@dataclass(frozen=True)
class Listed:
    """One key of a listing: its daemon id, and its record or why none is used."""

    key_id: str
    record: FleetRecord | None
    why: str = ""


#: Keys per page of a listing; halved while a page is too large to receive.
LIST_PAGE = 256


async def list_records(client: Etcd3Client, cluster: str, timeout_s: float) -> tuple[list[Listed], int]:
    """Every key under the cluster's prefix, checked (:func:`accepted`), at one revision: page by
    page, each page halved while etcd's answer is over gRPC's receive limit (records are
    bounded by etcd's request size, so one per page always fits). Returns the keys and the
    revision they were read at."""
    from etcd3aio import prefix_range_end

    assert client.kv is not None
    prefix = cluster_prefix(cluster)
    start, end, revision, limit = prefix, prefix_range_end(prefix), 0, LIST_PAGE
    listed: list[Listed] = []
    while True:
        try:
            page = await client.kv.get(start, range_end=end, revision=revision, limit=limit, timeout=timeout_s)
        except Exception as exc:  # etcd's client raises its own tree, or gRPC's
            if limit > 1 and _too_large(exc):
                limit //= 2
                continue
            raise
        revision = revision or page.header.revision
        for kv in page.kvs:
            key_id = kv.key[len(prefix) :].decode(errors="replace")
            try:
                listed.append(Listed(key_id, accepted(cluster, kv.key, kv.value, kv.lease)))
            except InvalidRequestError as exc:
                listed.append(Listed(key_id, None, str(exc)))
        if not page.more or not page.kvs:
            return listed, revision
        start = page.kvs[-1].key + b"\0"


def _too_large(exc: BaseException) -> bool:
    """Whether gRPC refused an answer as over its receive limit (etcd's client may wrap it)."""
    import grpc

    while exc is not None:
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def _is_local(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_of(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]") if ":" in address else address


@dataclass(frozen=True)
class RegistryUrl:
    """``etcd://h1:2379,h2:2379`` (plaintext) or ``etcds://...`` (TLS, with the daemon's own
    certificate files as the client's)."""

    endpoints: tuple[str, ...]
    tls: bool = False

    @classmethod
    def parse(cls, text: str) -> RegistryUrl:
        scheme, sep, rest = text.partition("://")
        if not sep or scheme not in ("etcd", "etcds"):
            raise ValueError(f"registry {text!r}: expected etcd://host:port[,host:port...] (or etcds:// for TLS)")
        endpoints = tuple(e.strip() for e in rest.rstrip("/").split(",") if e.strip())
        for e in endpoints:
            host, colon, port = e.rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"registry endpoint {e!r}: expected host:port")
        if not endpoints:
            raise ValueError(f"registry {text!r} names no endpoint")
        return cls(endpoints, scheme == "etcds")

    @property
    def spans_hosts(self) -> bool:
        """Whether any etcd member is off this host (then daemons of other hosts may read our
        record, and a loopback address in it would send them to themselves)."""
        return any(not _is_local(_host_of(e)) for e in self.endpoints)

    def __str__(self) -> str:
        return ("etcds://" if self.tls else "etcd://") + ",".join(self.endpoints)


def check_advertised(address: str, url: RegistryUrl) -> None:
    """Refuse a loopback or wildcard peer address in a registry other hosts read."""
    host = _host_of(address)
    wildcard = host in ("0.0.0.0", "::", "")
    if url.spans_hosts and (wildcard or _is_local(host)):
        raise ValueError(
            f"peer address {address!r} is not routable from other hosts, and registry {url} spans hosts: "
            "set peer_advertise to this node's routable host:port (a pod's: its status.podIP)"
        )


def etcd_client(url: RegistryUrl, tls: TlsFiles | None = None) -> Etcd3Client:
    """An etcd v3 client (not connected yet) for the registry's endpoints."""
    from etcd3aio import Etcd3Client

    if url.tls:
        if tls is None:
            raise ValueError(f"registry {url} asks for TLS: give tls_cert, tls_key and tls_ca")
        client = Etcd3Client(
            list(url.endpoints), rpc_max_attempts=1, ca_cert=tls.ca, cert_key=tls.key, cert_chain=tls.cert
        )
    else:
        client = Etcd3Client(list(url.endpoints), rpc_max_attempts=1)
    # gRPC's reconnect backoff grows to minutes while etcd is down: after a 10 s outage the
    # channel could come back 5 s after etcd did, past a short lease, and every daemon's record
    # would lapse. Retried every second instead (the registry's own cadence while unreachable).
    client._manager.grpc_options += [*RECONNECT_OPTIONS, ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]
    return client


#: The most one answer of etcd may hold: a watch answer can carry several records of up to
#: etcd's request limit (1.5 MiB by default); bounded, so a prefix filled by anyone with write
#: access costs a reader at most this much at a time (listings come in pages).
MAX_RECEIVE_BYTES = 16 << 20


#: The etcd channel's reconnect backoff: at most one second between tries.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass(frozen=True)
class FleetRecord:
    """What a daemon tells the fleet about itself."""

    daemon_id: str
    peer_address: str
    admin_address: str
    version: str
    protocol_version: int
    hostname: str
    started_at: float
    pid: int = 0
    #: Ways bytes can reach it: UCX transports, ``tcp-lanes``, ``direct-read``.
    transports: tuple[str, ...] = ()
    #: Memory it maps: ``host`` (always), ``cuda`` (with a GPU).
    memory_kinds: tuple[str, ...] = ("host",)
    tier_host_bytes: int = 0
    tier_disk_bytes: int = 0
    #: ``push``, ``layerwise``, ``heterogeneous-tp``, ``integrity:<mode>``, ``tier``.
    capabilities: tuple[str, ...] = ()

    def to_json(self) -> bytes:
        data = {"v": RECORD_VERSION, **asdict(self)}
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> FleetRecord:
        """Parse and check a record read from etcd (anyone with write access to etcd may have
        written it): InvalidRequestError when it is not a record of this version."""
        if len(raw) > MAX_RECORD_BYTES:
            raise InvalidRequestError(f"registry record of {len(raw)} bytes is too large")
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise InvalidRequestError(f"registry record is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("v") != RECORD_VERSION:
            raise InvalidRequestError("registry record is not a version-1 object")
        try:
            return cls(**_checked(data))
        except (TypeError, KeyError, ValueError) as exc:
            raise InvalidRequestError(f"malformed registry record: {exc}") from None


def _checked(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("daemon_id", "peer_address", "admin_address", "version", "hostname"):
        value = data[name]
        if not isinstance(value, str) or len(value) > _MAX_ID:
            raise ValueError(f"{name} must be a string of at most {_MAX_ID} characters")
        out[name] = value
    if not out["daemon_id"] or "/" in out["daemon_id"] or not out["peer_address"]:
        raise ValueError("daemon_id and peer_address must be set (and the id without '/')")
    for name in ("protocol_version", "pid", "tier_host_bytes", "tier_disk_bytes"):
        value = data.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer")
        out[name] = value
    started = data["started_at"]
    if not isinstance(started, (int, float)) or isinstance(started, bool):
        raise ValueError("started_at must be a number")
    out["started_at"] = float(started)
    for name in ("transports", "memory_kinds", "capabilities"):
        items = data.get(name, [])
        if (
            not isinstance(items, list)
            or len(items) > 64
            or not all(isinstance(i, str) and len(i) <= 64 for i in items)
        ):
            raise ValueError(f"{name} must be a list of at most 64 short strings")
        out[name] = tuple(items)
    return out
