"""gRPC listeners: each gets its services plus standard health checking and reflection."""

from __future__ import annotations

import grp
import os
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvxfer_client._config import channel_options

from .listen_errors import check_unix_dir, explain

__all__ = ["Listener", "start_listener"]


class Listener:
    def __init__(self, server: grpc.aio.Server, health_servicer: Any, services: Sequence[str], address: str) -> None:
        self.server = server
        self.health = health_servicer
        self.services = services
        self.address = address

    async def set_serving(self, serving: bool, services: Sequence[str] | None = None) -> None:
        """Set the health of ``services`` (default: the listener and each service it serves)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.services) if services is None else services:
            await self.health.set(name, status)


async def start_listener(
    name: str,
    address: str,
    adders: Sequence[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    credentials: grpc.ServerCredentials | None = None,
    socket_group: str = "",
) -> Listener:
    """Bind ``address`` ("unix:/path" or "host:port") and serve the given services on it.

    ``adders`` holds (add_XServicer_to_server, servicer, full service name) triples; a TCP
    address uses ``credentials`` (mTLS) when given; a Unix socket gets mode 0660 and, when
    named, ``socket_group``. Returns the listener with its actual address (the bound port when
    0 was asked for). A bind that fails raises :class:`ListenError` naming listener ``name``.
    """
    try:
        return await _start(address, adders, credentials, socket_group, name)
    except (OSError, RuntimeError) as exc:
        raise explain(name, address, exc) from None


async def _start(
    address: str,
    adders: Sequence[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    credentials: grpc.ServerCredentials | None,
    socket_group: str,
    name: str,
) -> Listener:
    # No SO_REUSEPORT: a second daemon on the same port must fail, not share it.
    server = grpc.aio.server(options=[*channel_options(), ("grpc.so_reuseport", 0)])
    names = []
    for add, servicer, service in adders:
        add(servicer, server)
        names.append(service)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        check_unix_dir(name, path)
        if os.path.exists(path):
            os.unlink(path)  # a stale socket of a previous run (the pid lock is held by the caller)
        server.add_insecure_port(address)
        bound = address
    else:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        host = address.rsplit(":", 1)[0]
        bound = f"{host}:{port}"
    await server.start()
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        os.chmod(path, 0o660)
        if socket_group:
            try:
                gid = int(socket_group) if socket_group.isdigit() else grp.getgrnam(socket_group).gr_gid
                os.chown(path, -1, gid)
            except (KeyError, OSError) as exc:
                await server.stop(None)
                raise OSError(f"cannot give {path} to group {socket_group!r}: {exc}") from None
    listener = Listener(server, health_servicer, names, bound)
    await listener.set_serving(True)
    return listener
