"""The registry is a hint, never an authority: a record forged for a daemon that is gone (by
anyone who may write to etcd), pointing at a listener the forger controls, gets no pull. The
decode daemon asks the daemon there who it is (Hello) and, over mTLS, which name its
certificate carries, before any offer id or token leaves it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import trustme

from bench.cluster import Cluster, Daemon, wait_for
from bench.etcd import SHAPE, EtcdCluster, registry_args
from kvxfer.proto import admin_pb2, peer_pb2, peer_pb2_grpc
from kvxfer.version import PROTOCOL_VERSION


def _nodes(daemon: Daemon) -> int:
    return int(daemon.admin("Status", admin_pb2.StatusRequest()).registry_nodes)


def _ticket_of_a_dead_daemon(cluster: Cluster, victim: Daemon, decode: Daemon) -> tuple[dict[str, Any], Any]:
    """A ticket of ``victim``'s, which is then SIGKILLed; returns it and the decode engine."""
    prefill, engine = cluster.engine(victim, "p"), cluster.engine(decode, "d")
    prefill("pool", shape=SHAPE, seed=2)
    engine("pool", shape=SHAPE)
    ticket = prefill("offer", requests=[[0, 1, 2]], lease_s=120)["tickets"][0]
    victim.kill()
    wait_for(lambda: f"registry.peer_left peer={victim.name}" in decode.log(), "the victim to leave", 30)
    return ticket, engine


def _forge(etcd: EtcdCluster, cluster_name: str, victim: str, address: str) -> None:
    record = {
        "v": 1,
        "daemon_id": victim,
        "peer_address": address,
        "admin_address": "",
        "version": "0",
        "protocol_version": PROTOCOL_VERSION,
        "hostname": "forger",
        "started_at": time.time(),
    }
    lease = etcd.ctl("lease", "grant", "120").split()[1]  # anyone who may write to etcd may grant
    etcd.ctl("put", f"--lease={lease}", f"/kvxfer/{cluster_name}/daemons/{victim}", json.dumps(record))


def test_a_forged_record_pointing_at_another_daemon_is_refused_in_hello(etcd: EtcdCluster) -> None:
    with Cluster() as cluster:
        victim = cluster.daemon("victim", *registry_args(etcd, "forge"))
        decode = cluster.daemon("decode", *registry_args(etcd, "forge"))
        mallory = cluster.daemon("mallory")  # a real daemon the forger runs, outside the registry
        ticket, engine = _ticket_of_a_dead_daemon(cluster, victim, decode)
        _forge(etcd, "forge", "victim", mallory.info["peer_address"])
        wait_for(lambda: _nodes(decode) == 2, "the forged record to reach the decode daemon")
        result = engine("pull", pulls=[[ticket, [0, 1, 2]]], timeout_s=20)["results"][0]
        assert not result["ok"] and result["type"] == "UnavailableError", result
        assert "peer.registry_refused peer=victim" in decode.log()
        assert "said Hello as 'mallory'" in decode.log()
        # Nothing of the offer reached the forger's daemon: no transfer, no offer id, no token.
        listed = mallory.admin("ListTransfers", admin_pb2.ListTransfersRequest(include_finished=True))
        assert list(listed.transfers) == []
        assert ticket["offer_id"] not in mallory.log() and ticket["token"] not in mallory.log()


class _Impostor(peer_pb2_grpc.PeerServiceServicer):
    """A PeerService that says Hello as whichever daemon it is asked for, and records every
    call that reaches it."""

    def __init__(self, claims: str) -> None:
        self.claims = claims
        self.calls: list[str] = []

    def Hello(self, request: peer_pb2.HelloRequest, context: Any) -> peer_pb2.HelloResponse:  # noqa: N802
        self.calls.append("Hello")
        identity = peer_pb2.PeerIdentity(daemon_id=self.claims, protocol_version=PROTOCOL_VERSION, version="0")
        return peer_pb2.HelloResponse(identity=identity)

    def Transfers(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:  # noqa: N802
        for message in request_iterator:
            self.calls.append(f"Transfers {message}")
        return iter(())


@pytest.fixture
def pki(tmp_path: Any) -> dict[str, list[str]]:
    """Certificates of one CA: each names its daemon id (and 127.0.0.1)."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    flags = {}
    for name in ("victim", "decode", "mallory"):
        cert = ca.issue_cert("127.0.0.1", "localhost", name)
        cert.cert_chain_pems[0].write_to_path(str(tmp_path / f"{name}.pem"))
        cert.private_key_pem.write_to_path(str(tmp_path / f"{name}.key"))
        flags[name] = [
            *("--tls-cert", str(tmp_path / f"{name}.pem"), "--tls-key", str(tmp_path / f"{name}.key")),
            *("--tls-ca", str(tmp_path / "ca.pem")),
        ]
    return flags


def test_over_mtls_a_listener_whose_certificate_names_another_id_gets_no_hello(
    etcd: EtcdCluster, pki: dict[str, list[str]]
) -> None:
    """The forger holds a certificate of the cluster's CA (for its own name) and a listener
    that claims to be the victim: the TLS handshake checks the victim's name and fails, so
    not even Hello reaches it."""
    with Cluster() as cluster:
        victim = cluster.daemon("victim", *registry_args(etcd, "forge-tls"), *pki["victim"])
        decode = cluster.daemon("decode", *registry_args(etcd, "forge-tls"), *pki["decode"])
        ticket, engine = _ticket_of_a_dead_daemon(cluster, victim, decode)
        impostor = _Impostor(claims="victim")
        server = grpc.server(futures.ThreadPoolExecutor(4))
        peer_pb2_grpc.add_PeerServiceServicer_to_server(impostor, server)
        tls = [open(p, "rb").read() for p in (pki["mallory"][3], pki["mallory"][1], pki["mallory"][5])]  # noqa: SIM115
        creds = grpc.ssl_server_credentials([(tls[0], tls[1])], root_certificates=tls[2], require_client_auth=True)
        port = server.add_secure_port("127.0.0.1:0", creds)
        server.start()
        try:
            _forge(etcd, "forge-tls", "victim", f"127.0.0.1:{port}")
            wait_for(lambda: _nodes(decode) == 2, "the forged record to reach the decode daemon")
            result = engine("pull", pulls=[[ticket, [0, 1, 2]]], timeout_s=20)["results"][0]
        finally:
            server.stop(None)
        assert not result["ok"] and result["type"] == "UnavailableError", result
        assert "peer.registry_refused peer=victim" in decode.log()
        assert impostor.calls == [], impostor.calls  # no Hello, no transfer, no token
