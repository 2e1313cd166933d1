"""gRPC listeners: each gets its services plus standard health checking and reflection."""

from __future__ import annotations

import grp
import os
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvxfer.defaults import channel_options

from .listen_errors import check_unix_dir, explain

__all__ = ["Listener", "Servicer", "bind_listener"]


Servicer = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]


class Listener:
    """One gRPC server on one address: bound first (:func:`bind_listener`, so the daemon's
    parts are built knowing every address), then serving (:meth:`serve`)."""

    def __init__(self, server: grpc.aio.Server, name: str, address: str, bound: str, socket_group: str) -> None:
        self.server = server
        self.name = name
        self.asked = address
        #: The actual address (the bound port where 0 was asked for).
        self.address = bound
        self.socket_group = socket_group
        self.health = health.aio.HealthServicer()
        self.services: list[str] = []

    async def serve(self, servicers: Sequence[Servicer]) -> None:
        """Serve ``servicers`` ((add_XServicer_to_server, servicer, full service name) triples)
        plus health checking and reflection; a Unix socket gets mode 0660 and, when named,
        its group. Raises :class:`ListenError` naming the listener."""
        try:
            await self._serve(servicers)
        except (OSError, RuntimeError) as exc:
            raise explain(self.name, self.asked, exc) from None

    async def _serve(self, servicers: Sequence[Servicer]) -> None:
        for add, servicer, service in servicers:
            add(servicer, self.server)
            self.services.append(service)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        await self.server.start()
        if self.asked.startswith("unix:"):
            path = self.asked.removeprefix("unix:")
            os.chmod(path, 0o660)
            if self.socket_group:
                group = self.socket_group
                try:
                    gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
                    os.chown(path, -1, gid)
                except (KeyError, OSError) as exc:
                    await self.server.stop(None)
                    raise OSError(f"cannot give {path} to group {group!r}: {exc}") from None
        await self.set_serving(True)

    async def set_serving(self, serving: bool, services: Sequence[str] | None = None) -> None:
        """Set the health of ``services`` (default: the listener and each service it serves)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.services) if services is None else services:
            await self.health.set(name, status)


def bind_listener(
    name: str, address: str, credentials: grpc.ServerCredentials | None = None, socket_group: str = ""
) -> Listener:
    """Bind ``address`` ("unix:/path" or "host:port"; a TCP address uses ``credentials``, mTLS,
    when given) without serving yet. A bind that fails raises :class:`ListenError` naming
    listener ``name``."""
    try:
        return _bind(name, address, credentials, socket_group)
    except (OSError, RuntimeError) as exc:
        raise explain(name, address, exc) from None


def _bind(name: str, address: str, credentials: grpc.ServerCredentials | None, socket_group: str) -> Listener:
    # No SO_REUSEPORT: a second daemon on the same port must fail, not share it.
    server = grpc.aio.server(options=[*channel_options(), ("grpc.so_reuseport", 0)])
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
    return Listener(server, name, address, bound, socket_group)
