"""The composition root: the daemon's parts built and wired in one place.

In order: every listener is bound (so every address is known), the :class:`~._node.Node` is
built whole from the settings, the data plane and those addresses, then each listener serves
its services, and the fd socket and the metrics endpoint start. Nothing is built half and
filled in later. A listener that cannot start raises :class:`~.control.listen_errors.ListenError`
(after closing what was bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvxfer.proto import admin_pb2, admin_pb2_grpc, engine_pb2, engine_pb2_grpc, peer_pb2_grpc
from kvxfer.tls import TlsFiles

from ._config import Settings
from ._metrics import serve_metrics
from ._node import Addresses, Node
from .control.admin_service import AdminService
from .control.engine_service import EngineService
from .control.fd_socket import FdSocket
from .control.listen_errors import ListenError, explain
from .control.server import Listener, bind_listener
from .dataplane.ucx import UcxTransport
from .peer.service import PeerService

__all__ = ["ADMIN_SERVICE", "ENGINE_SERVICE", "PEER_SERVICE", "Running", "start"]

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
PEER_SERVICE = "kvxfer.v1.PeerService"
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


@dataclass
class Running:
    """A started daemon: its node and everything listening for it."""

    node: Node
    peer_listener: Listener
    listeners: list[Listener]
    fd_socket: FdSocket
    metrics_server: Any = None
    metrics_address: str = ""


async def start(
    settings: Settings, ucx: UcxTransport | None, tls: TlsFiles | None, request_drain: Callable[[], None]
) -> Running:
    """Bind, build, serve (see the module's docstring)."""
    bound: list[Listener] = []
    try:
        return await _start(settings, ucx, tls, request_drain, bound)
    except ListenError:
        for listener in bound:
            await listener.server.stop(None)
        raise


async def _start(
    settings: Settings,
    ucx: UcxTransport | None,
    tls: TlsFiles | None,
    request_drain: Callable[[], None],
    bound: list[Listener],
) -> Running:
    server_creds = tls.server_credentials() if tls else None
    peer = bind_listener("peer", settings.peer_listen, server_creds)
    bound.append(peer)
    engine = bind_listener("engine socket", "unix:" + settings.engine_socket, None, settings.engine_socket_group)
    bound.append(engine)
    admin = bind_listener("admin", settings.admin_listen, server_creds) if settings.admin_listen else None
    if admin is not None:
        bound.append(admin)
    lanes_listen = ""
    if ucx is not None and settings.tcp_lanes != "off":
        lanes_listen = settings.tcp_lanes_listen or peer.address.rsplit(":", 1)[0] + ":0"
    addresses = Addresses(settings.peer_advertise or peer.address, admin.address if admin else "", lanes_listen)
    try:
        node = Node(settings, ucx, addresses, tls)
    except (OSError, ValueError) as exc:
        raise explain("tcp lanes", lanes_listen, exc) from None
    add_admin = admin_pb2_grpc.add_AdminServiceServicer_to_server
    await peer.serve([(peer_pb2_grpc.add_PeerServiceServicer_to_server, PeerService(node), PEER_SERVICE)])
    await engine.serve(
        [
            (engine_pb2_grpc.add_EngineServiceServicer_to_server, EngineService(node), ENGINE_SERVICE),
            (add_admin, AdminService(node, request_drain, allow_changes=True), ADMIN_SERVICE),
        ]
    )
    if admin is not None:
        # Over TCP, cancel and drain need a client certificate signed by our CA.
        tcp_admin = AdminService(node, request_drain, allow_changes=tls is not None)
        await admin.serve([(add_admin, tcp_admin, ADMIN_SERVICE)])
    fd_socket = FdSocket(settings.engine_socket + ".fds", node.sessions.find, settings.engine_socket_group)
    try:
        fd_socket.start()
    except (OSError, KeyError) as exc:
        raise explain("fd socket", "unix:" + fd_socket.path, exc) from None
    running = Running(node, peer, list(bound), fd_socket)
    if settings.metrics_listen:
        try:
            running.metrics_server, running.metrics_address = serve_metrics(node.metrics, settings.metrics_listen)
        except OSError as exc:
            fd_socket.close()
            raise explain("metrics", settings.metrics_listen, exc) from None
    return running
