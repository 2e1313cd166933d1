"""Hostile input: generated and hand-written bad requests to every RPC, garbage bytes to every
port. The daemon never crashes, answers each request with a client-error status (never
INTERNAL or UNKNOWN), and a handoff running beside the abuse still arrives byte-exact."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bench.cluster import Cluster, Daemon
from kvxfer.proto import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
)

#: Answers a hostile request may get. INTERNAL and UNKNOWN would mean an unhandled bug.
CLIENT_ERRORS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAVAILABLE,  # e.g. a ticket naming an unreachable peer
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
SHAPE = {"layers": 2, "blocks": 64, "block_bytes": 4096}
EXAMPLES = 60
#: Every example is a round trip to real daemons: a failure is reported as found, not shrunk
#: (shrinking a hang retries it for each candidate, and a test timeout only counts as one more
#: failing example to shrink).
ATTACK = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
    phases=[Phase.explicit, Phase.generate],
)


class Target:
    """A daemon under attack, with real ids for the generators to mix in."""

    def __init__(self, cluster: Cluster) -> None:
        self.daemon = cluster.daemon("victim", "--peer-timeout-s", "0.5", "--max-offers", "5000")
        self.peer = cluster.daemon("bystander")
        self.prefill = cluster.engine(self.daemon, "honest-prefill")
        self.decode = cluster.engine(self.peer, "honest-decode")
        self.prefill("pool", shape=SHAPE, seed=9)
        self.decode("pool", shape=SHAPE)
        with grpc.insecure_channel("unix:" + self.daemon.socket) as ch:
            stub = admin_pb2_grpc.AdminServiceStub(ch)
            pools = stub.ListPools(admin_pb2.ListPoolsRequest(), timeout=5).pools
        honest = next(p for p in pools if p.engine_name == "honest-prefill")
        self.pool_id = honest.pool_id
        self.session_id = self.prefill.session_id  # the engine's own (ListPools shows a label)
        self.ticket = self.prefill("offer", requests=[[1, 2]], lease_s=600)["tickets"][0]
        # Generated requests get the ids of a decoy engine (they may deregister its pool,
        # withdraw its offers); the honest pair above must be untouched by all of it.
        decoy = cluster.engine(self.daemon, "decoy")
        decoy("pool", shape=SHAPE, seed=1)
        decoy_ticket = decoy("offer", requests=[[3], [4, 5]], lease_s=600)["tickets"]
        with grpc.insecure_channel("unix:" + self.daemon.socket) as ch:
            stub = admin_pb2_grpc.AdminServiceStub(ch)
            decoy_pool = next(
                p for p in stub.ListPools(admin_pb2.ListPoolsRequest(), timeout=5).pools if p.engine_name == "decoy"
            )
        self.ids = [
            decoy_pool.pool_id,
            decoy.session_id,
            *(t["offer_id"] for t in decoy_ticket),
            "victim",
            self.daemon.info["peer_address"],
        ]


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    with Cluster() as cluster:
        yield Target(cluster)


def message_strategy(descriptor: Descriptor, ids: list[str], depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Random field values for any message type, real ids mixed into strings."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in descriptor.fields:
        value = _field_strategy(f, ids, depth)
        if value is None:
            continue
        fields[f.name] = st.lists(value, max_size=6) if f.is_repeated else value
    return st.fixed_dictionaries({}, optional=fields)


def _field_strategy(f: FieldDescriptor, ids: list[str], depth: int) -> st.SearchStrategy[Any] | None:
    t = f.type
    if t == FieldDescriptor.TYPE_MESSAGE:
        return None if depth > 2 else message_strategy(f.message_type, ids, depth + 1)
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(ids), st.text(max_size=40), st.just("../../etc/passwd"), st.just("a" * 300))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values] + [99])
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1))
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return st.integers(-(2**31), 2**31 - 1)
    return st.integers(-(2**63), 2**63 - 1)


def build(cls: type[Message], data: dict[str, Any]) -> Message:
    msg = cls()
    for name, value in data.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            sub_cls = type(getattr(msg, name).add() if field.is_repeated else getattr(msg, name))
            if field.is_repeated:
                del getattr(msg, name)[:]
                getattr(msg, name).extend(build(sub_cls, v) for v in value)
            else:
                getattr(msg, name).CopyFrom(build(sub_cls, value))
        elif field.is_repeated:
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


def call(target: str, stub_cls: Any, method: str, request: Message) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        try:
            getattr(stub_cls(channel), method)(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


UNARY_RPCS = [
    ("engine", engine_pb2_grpc.EngineServiceStub, "RegisterPool", engine_pb2.RegisterPoolRequest),
    ("engine", engine_pb2_grpc.EngineServiceStub, "DeregisterPool", engine_pb2.DeregisterPoolRequest),
    ("engine", engine_pb2_grpc.EngineServiceStub, "Offer", engine_pb2.OfferRequest),
    ("engine", engine_pb2_grpc.EngineServiceStub, "Pull", engine_pb2.PullRequest),
    ("engine", engine_pb2_grpc.EngineServiceStub, "Release", engine_pb2.ReleaseRequest),
    ("engine", engine_pb2_grpc.EngineServiceStub, "Cancel", engine_pb2.CancelRequest),
    ("engine", engine_pb2_grpc.EngineServiceStub, "ExtendLease", engine_pb2.ExtendLeaseRequest),
    ("engine", engine_pb2_grpc.EngineServiceStub, "Push", engine_pb2.PushRequest),
    # A well-formed Receive waits for its push: past this test's 10 s, DEADLINE_EXCEEDED.
    ("engine", engine_pb2_grpc.EngineServiceStub, "Receive", engine_pb2.ReceiveRequest),
    ("peer", peer_pb2_grpc.PeerServiceStub, "Hello", peer_pb2.HelloRequest),
    ("peer", peer_pb2_grpc.PeerServiceStub, "ExtendLease", peer_pb2.PeerExtendLeaseRequest),
    ("peer", peer_pb2_grpc.PeerServiceStub, "Announce", peer_pb2.PushAnnouncement),
    ("admin", admin_pb2_grpc.AdminServiceStub, "Cancel", admin_pb2.AdminCancelRequest),
    ("admin", admin_pb2_grpc.AdminServiceStub, "ListTransfers", admin_pb2.ListTransfersRequest),
]


def address(target: Target, port: str) -> str:
    d: Daemon = target.daemon
    return {"engine": "unix:" + d.socket, "peer": d.info["peer_address"], "admin": d.info["admin_address"]}[port]


@pytest.mark.parametrize(
    ("port", "stub", "method", "request_cls"), UNARY_RPCS, ids=[f"{r[0]}.{r[2]}" for r in UNARY_RPCS]
)
def test_generated_requests_get_client_errors_and_never_crash_the_daemon(
    target: Target, port: str, stub: Any, method: str, request_cls: type[Message]
) -> None:
    codes: set[grpc.StatusCode] = set()

    @ATTACK
    @given(message_strategy(request_cls.DESCRIPTOR, target.ids))
    def attack(data: dict[str, Any]) -> None:
        code = call(address(target, port), stub, method, build(request_cls, data))
        codes.add(code)
        assert code in CLIENT_ERRORS, f"{method}({data}) answered {code}"

    attack()
    assert target.daemon.proc is not None and target.daemon.proc.poll() is None
    if method != "ListTransfers":  # the one RPC every well-typed request may call
        assert codes - {grpc.StatusCode.OK}, "no request was refused: the generator did not reach validation"


def call_stream(target: Target, requests: list[engine_pb2.CallRequest]) -> list[engine_pb2.CallResponse]:
    """Send ``requests`` on one ``Calls`` stream, close it, return every answer (those that
    came within 10 s: a well-formed Receive waits that long for its push)."""
    got: list[engine_pb2.CallResponse] = []
    with grpc.insecure_channel("unix:" + target.daemon.socket) as channel:
        try:
            for answer in engine_pb2_grpc.EngineServiceStub(channel).Calls(iter(requests), timeout=10):
                got.append(answer)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or not any(r.HasField("receive") for r in requests):
                raise
    return got


def test_generated_call_stream_requests_get_client_errors_and_never_crash_the_daemon(target: Target) -> None:
    codes: set[int] = set()

    @ATTACK
    @given(st.lists(message_strategy(engine_pb2.CallRequest.DESCRIPTOR, target.ids), min_size=1, max_size=6))
    def attack(data: list[dict[str, Any]]) -> None:
        requests = [build(engine_pb2.CallRequest, d) for d in data]
        for answer in call_stream(target, requests):
            if answer.WhichOneof("result") == "error":
                codes.add(answer.error.code)
                assert grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == answer.error.code)) in (
                    CLIENT_ERRORS
                ), f"{requests} answered {answer}"

    attack()
    assert target.daemon.proc is not None and target.daemon.proc.poll() is None
    assert codes, "no call was refused: the generator did not reach validation"


def test_calls_naming_no_call_are_refused_and_unknown_abandons_ignored(target: Target) -> None:
    offer = engine_pb2.OfferRequest(pool_id=target.pool_id, block_ids=[30], session_id=target.session_id)
    answers = call_stream(
        target,
        [
            engine_pb2.CallRequest(call_id=1),  # no call at all
            engine_pb2.CallRequest(call_id=99, abandon=True),  # nothing of that id runs
            engine_pb2.CallRequest(call_id=2, offer=offer),
        ],
    )
    by_id = {a.call_id: a for a in answers}
    assert sorted(by_id) == [1, 2]
    assert by_id[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "names no call" in by_id[1].error.details
    assert by_id[2].WhichOneof("result") == "offer"  # the stream went on serving


def test_a_call_abandoned_while_its_answer_is_written_still_lets_the_stream_end(target: Target) -> None:
    # The abandon can arrive while the daemon writes that call's answer; cancelling that write
    # once left the stream unable to end. Each stream must close well inside its deadline.
    bad = engine_pb2.OfferRequest(pool_id="../../etc/passwd")
    good = engine_pb2.OfferRequest(pool_id=target.pool_id, block_ids=[31])
    for round_ in range(40):
        offer = bad if round_ % 2 else good
        answers = call_stream(
            target, [engine_pb2.CallRequest(call_id=0, offer=offer), engine_pb2.CallRequest(call_id=0, abandon=True)]
        )
        assert len(answers) <= 1


def hostile_pulls(t: Target) -> list[tuple[str, engine_pb2.PullRequest]]:
    good = common_pb2.Ticket(
        version=1,
        daemon_id="victim",
        peer_address=t.daemon.info["peer_address"],
        offer_id=t.ticket["offer_id"],
        token=bytes.fromhex(t.ticket["token"]),
        num_blocks=2,
        fingerprint=t.ticket["fingerprint"],
        total_bytes=t.ticket["total_bytes"],
    )

    def pull(ids: list[int], **ticket_changes: Any) -> engine_pb2.PullRequest:
        ticket = common_pb2.Ticket()
        ticket.CopyFrom(good)
        for k, v in ticket_changes.items():
            setattr(ticket, k, v)
        return engine_pb2.PullRequest(
            ticket=ticket, pool_id=t.pool_id, block_ids=ids, timeout_s=5, session_id=t.session_id
        )

    return [
        ("block id out of range", pull([1, 64])),
        ("duplicated block ids", pull([3, 3])),
        ("wrong count", pull([3])),
        ("empty", pull([])),
        ("wrong token", pull([3, 4], token=b"\1" * 16)),
        ("short token", pull([3, 4], token=b"\1")),
        ("wrong fingerprint", pull([3, 4], fingerprint="0" * 32)),
        ("unknown offer", pull([3, 4], offer_id="off-nope")),
    ]


def test_hand_written_hostile_pulls_are_refused_with_the_right_code_and_the_offer_survives(target: Target) -> None:
    expected = {
        "block id out of range": grpc.StatusCode.INVALID_ARGUMENT,
        "duplicated block ids": grpc.StatusCode.INVALID_ARGUMENT,
        "wrong count": grpc.StatusCode.INVALID_ARGUMENT,
        "empty": grpc.StatusCode.INVALID_ARGUMENT,
        "wrong token": grpc.StatusCode.PERMISSION_DENIED,
        "short token": grpc.StatusCode.INVALID_ARGUMENT,
        "wrong fingerprint": grpc.StatusCode.FAILED_PRECONDITION,
        "unknown offer": grpc.StatusCode.NOT_FOUND,
    }
    got = {
        what: call("unix:" + target.daemon.socket, engine_pb2_grpc.EngineServiceStub, "Pull", req)
        for what, req in hostile_pulls(target)
    }
    assert got == expected
    # The offer survived every one of them: the honest decode engine still pulls it.
    result = target.decode("pull", pulls=[[target.ticket, [10, 11]]])["results"][0]
    assert result["ok"], result
    assert target.decode("verify", seed=9, pairs=[[[1, 2], [10, 11]]])["verified"]


@pytest.mark.parametrize(
    ("what", "request_"),
    [
        ("absurd lease", engine_pb2.OfferRequest(block_ids=[1], lease_s=1e12)),
        ("negative lease", engine_pb2.OfferRequest(block_ids=[1], lease_s=-1)),
        ("nan lease", engine_pb2.OfferRequest(block_ids=[1], lease_s=float("nan"))),
        ("empty offer", engine_pb2.OfferRequest(block_ids=[])),
        ("out of range", engine_pb2.OfferRequest(block_ids=[64])),
        ("duplicates", engine_pb2.OfferRequest(block_ids=[5, 5])),
    ],
)
def test_hostile_offers_are_invalid_arguments(target: Target, what: str, request_: engine_pb2.OfferRequest) -> None:
    request_.pool_id = target.pool_id
    request_.session_id = target.session_id
    code = call("unix:" + target.daemon.socket, engine_pb2_grpc.EngineServiceStub, "Offer", request_)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, what


@pytest.mark.parametrize(
    ("what", "buffer", "code"),
    [
        ("path traversal", common_pb2.BufferSpec(kind=1, size=4096, shm_name="../../etc/passwd"), "INVALID_ARGUMENT"),
        ("missing shm", common_pb2.BufferSpec(kind=1, size=4096, shm_name="kvxfer-nope"), "INVALID_ARGUMENT"),
        ("no kind", common_pb2.BufferSpec(size=4096, shm_name="x"), "INVALID_ARGUMENT"),
        ("unknown fd handle", common_pb2.BufferSpec(kind=1, size=4096, fd_handle="fd-0123"), "INVALID_ARGUMENT"),
        ("no fd handle", common_pb2.BufferSpec(kind=1, size=4096), "INVALID_ARGUMENT"),
        # The target's engine never attached its process: no address of it is looked at.
        (
            "process memory, not attached",
            common_pb2.BufferSpec(kind=3, size=4096, process_address=1 << 40),
            "INVALID_ARGUMENT",
        ),
        ("process memory, no address", common_pb2.BufferSpec(kind=3, size=4096), "INVALID_ARGUMENT"),
        ("unknown kind", common_pb2.BufferSpec(kind=9, size=4096), "INVALID_ARGUMENT"),
    ],
)
def test_hostile_pool_registrations_are_refused(target: Target, what: str, buffer: Any, code: str) -> None:
    layout = common_pb2.Layout(num_blocks=1, regions=[common_pb2.Region(block_stride=4096, block_bytes=4096)])
    req = engine_pb2.RegisterPoolRequest(session_id=target.session_id, buffers=[buffer], layout=layout)
    got = call("unix:" + target.daemon.socket, engine_pb2_grpc.EngineServiceStub, "RegisterPool", req)
    assert got.name == code, what


def test_a_message_over_the_size_limit_is_refused(target: Target) -> None:
    req = engine_pb2.ReleaseRequest(offer_id="x" * (17 << 20))
    code = call("unix:" + target.daemon.socket, engine_pb2_grpc.EngineServiceStub, "Release", req)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def _garbage(address: str, payload: bytes) -> None:
    family = socket.AF_UNIX if address.startswith("/") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        if family == socket.AF_UNIX:
            s.connect(address)
        else:
            host, port = address.rsplit(":", 1)
            s.connect((host, int(port)))
        try:
            s.sendall(payload)
            s.recv(4096)
        except OSError:
            pass


def test_garbage_bytes_on_every_port_while_a_handoff_runs(target: Target) -> None:
    d = target.daemon
    ports = [d.socket, d.info["peer_address"], d.info["admin_address"], d.info["metrics_address"]]
    rng = random.Random(5)
    payloads = [rng.randbytes(rng.randint(1, 4096)) for _ in range(40)]
    payloads += [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.randbytes(512), b"\x00" * 65536, b"GET / HTTP/1.1\r\n\r\n"]
    result: dict[str, Any] = {}

    def honest() -> None:
        tickets = target.prefill("offer", requests=[[i] for i in range(20, 40)])["tickets"]
        result["pull"] = target.decode("pull", pulls=[[t, [i]] for t, i in zip(tickets, range(20, 40), strict=True)])

    worker = threading.Thread(target=honest)
    worker.start()
    for payload in payloads:
        for port in ports:
            _garbage(port, payload)
    worker.join(60)
    assert all(r["ok"] for r in result["pull"]["results"])
    pairs = [[[i], [i]] for i in range(20, 40)]
    assert target.decode("verify", seed=9, pairs=pairs)["verified"]
    for port in ("unix:" + d.socket, d.info["peer_address"], d.info["admin_address"]):
        with grpc.insecure_channel(port) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    assert d.proc is not None and d.proc.poll() is None
