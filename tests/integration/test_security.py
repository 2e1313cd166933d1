"""mTLS on the TCP listeners, mutating admin calls only over the Unix socket or mTLS, and the
engine socket's mode and group. Certificates come from throwaway CAs made by the test."""

from __future__ import annotations

import grp
import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cluster import Cluster, _env


@dataclass
class Identity:
    cert: str
    key: str
    ca: str

    def flags(self) -> list[str]:
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]

    def credentials(self) -> grpc.ChannelCredentials:
        files = [open(p, "rb").read() for p in (self.ca, self.key, self.cert)]  # noqa: SIM115
        return grpc.ssl_channel_credentials(
            root_certificates=files[0], private_key=files[1], certificate_chain=files[2]
        )


def _identity(ca: trustme.CA, directory: str, name: str) -> Identity:
    """A certificate for 127.0.0.1 and ``name`` (a daemon's certificate names its daemon id)."""
    cert = ca.issue_cert("127.0.0.1", "localhost", name)
    paths = {kind: os.path.join(directory, f"{name}.{kind}.pem") for kind in ("cert", "key", "ca")}
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    ca.cert_pem.write_to_path(paths["ca"])
    return Identity(paths["cert"], paths["key"], paths["ca"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    directory = str(tmp_path_factory.mktemp("pki"))
    ours, theirs = trustme.CA(), trustme.CA()
    return {
        "daemon": _identity(ours, directory, "a"),
        "daemon-b": _identity(ours, directory, "b"),
        "operator": _identity(ours, directory, "operator"),
        "stranger": _identity(theirs, directory, "stranger"),
    }


@pytest.fixture(scope="module")
def tls_cluster(pki: dict[str, Identity]) -> Iterator[Cluster]:
    with Cluster() as cluster:
        cluster.daemon("a", *pki["daemon"].flags())
        cluster.daemon("b", *pki["daemon-b"].flags())
        yield cluster


def health(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    channel = grpc.secure_channel(address, credentials) if credentials is not None else grpc.insecure_channel(address)
    with channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        return int(resp.status)


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvxfer_client._ctl", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)


def test_peers_talk_over_mtls_and_a_remote_handoff_works(tls_cluster: Cluster) -> None:
    a, b = tls_cluster.daemons
    assert a.info["tls"] and b.info["tls"]
    prefill, decode = tls_cluster.engine(a, "tls-prefill"), tls_cluster.engine(b, "tls-decode")
    shape = {"layers": 2, "blocks": 16, "block_bytes": 8192}
    prefill("pool", shape=shape, seed=4)
    decode("pool", shape=shape)
    pairs = [([3, 1, 9], [0, 7, 2])]
    ticket = prefill("offer", requests=[pairs[0][0]])["tickets"][0]
    assert decode("pull", pulls=[[ticket, pairs[0][1]]])["results"][0]["ok"]
    assert decode("verify", seed=4, pairs=pairs)["verified"]


@pytest.mark.parametrize("port", ["peer_address", "admin_address"])
def test_a_plaintext_client_is_refused(tls_cluster: Cluster, port: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        health(tls_cluster.daemons[0].info[port], None)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("port", ["peer_address", "admin_address"])
def test_a_client_signed_by_another_ca_is_refused(tls_cluster: Cluster, pki: dict[str, Identity], port: str) -> None:
    stranger = pki["stranger"]
    # The stranger trusts our CA (so it could reach us) but presents a certificate of its own CA.
    creds = Identity(stranger.cert, stranger.key, pki["daemon"].ca).credentials()
    with pytest.raises(grpc.RpcError) as info:
        health(tls_cluster.daemons[0].info[port], creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_right_certificate_reads_and_may_cancel_over_tcp(tls_cluster: Cluster, pki: dict[str, Identity]) -> None:
    a = tls_cluster.daemons[0]
    op = pki["operator"]
    assert health(a.info["admin_address"], op.credentials()) == health_pb2.HealthCheckResponse.SERVING
    prefill = tls_cluster.engine(a, "tls-cancel")
    prefill("pool", shape={"layers": 1, "blocks": 4, "block_bytes": 4096}, seed=1)
    offer = prefill("offer", requests=[[0]], lease_s=300)["tickets"][0]["offer_id"]
    remote = ["--addr", a.info["admin_address"], *op.flags()]
    assert offer in {o["offer"] for o in json.loads(ctl(*remote, "--json", "offers").stdout)}
    assert ctl(*remote, "health").stdout.strip() == "serving"
    cancelled = ctl(*remote, "cancel", offer)
    assert cancelled.returncode == 0, cancelled.stderr
    assert prefill("released", offer_ids=[offer])["reasons"] == ["cancelled"]
    # Without certificates the same port is unreachable for kvxferctl (exit 3).
    assert ctl("--addr", a.info["admin_address"], "offers").returncode == 3
    # Half a TLS configuration is a usage error.
    assert ctl("--addr", a.info["admin_address"], "--tls-cert", op.cert, "offers").returncode == 2


def test_the_engine_socket_is_0660_and_owned_by_the_configured_group(cluster: Cluster) -> None:
    group = grp.getgrgid(1).gr_name if os.geteuid() == 0 else grp.getgrgid(os.getgid()).gr_name
    d = cluster.daemon("a", "--engine-socket-group", group)
    st = os.stat(d.socket)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert grp.getgrgid(st.st_gid).gr_name == group


def test_a_daemon_with_half_a_tls_configuration_refuses_to_start(cluster: Cluster, pki: dict[str, Identity]) -> None:
    with pytest.raises(RuntimeError, match="tls_cert, tls_key and tls_ca"):
        cluster.daemon("a", "--tls-cert", pki["daemon"].cert)


def test_a_peer_cannot_claim_another_daemons_id_under_mtls(tls_cluster: Cluster, pki: dict[str, Identity]) -> None:
    """Daemon b's certificate (of the cluster's CA) gets in, but a Hello, a transfer or a tier
    request claiming daemon a's id is refused: the id must be named by the certificate."""
    from kvxfer.proto import peer_pb2, peer_pb2_grpc
    from kvxfer.version import PROTOCOL_VERSION

    a = tls_cluster.daemons[0]
    with grpc.secure_channel(a.info["peer_address"], pki["daemon-b"].credentials()) as channel:
        peer = peer_pb2_grpc.PeerServiceStub(channel)

        def hello(daemon_id: str) -> peer_pb2.HelloResponse:
            identity = peer_pb2.PeerIdentity(daemon_id=daemon_id, protocol_version=PROTOCOL_VERSION)
            return peer.Hello(peer_pb2.HelloRequest(identity=identity), timeout=10)

        for forged in ("a", "somebody-else"):
            with pytest.raises(grpc.RpcError) as refused:
                hello(forged)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "does not name daemon id" in (refused.value.details() or "")
        with pytest.raises(grpc.RpcError) as refused:
            peer.TierOffer(peer_pb2.PeerTierOfferRequest(daemon_id="a"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        start = peer_pb2.TransferStart(
            transfer_id="t-forged", offer_id="off-x", receiver_daemon_id="a", chunk_bytes=1 << 20
        )
        answered = threading.Event()

        def requests() -> Iterator[peer_pb2.TransferClientMessage]:
            yield peer_pb2.TransferClientMessage(transfer_id="t-forged", start=start)
            # Held open as a puller holds its stream: a half-closed one says the puller left,
            # and the daemon owes a puller that left no answer.
            answered.wait(10)

        answers = peer.Transfers(requests(), timeout=10)
        failed = next(iter(answers)).failed
        answered.set()
        assert failed.code == grpc.StatusCode.PERMISSION_DENIED.value[0], failed
    assert a.proc is not None and a.proc.poll() is None
