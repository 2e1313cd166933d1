"""Defaults the SDK and the daemon share: where the daemon listens, and the gRPC channel limits
on both ends of every channel."""

from __future__ import annotations

import os

__all__ = ["MAX_MESSAGE_BYTES", "channel_options", "default_socket_path"]

#: gRPC message size limit on every channel and server (block id lists stay far below it).
MAX_MESSAGE_BYTES = 16 << 20


def default_socket_path() -> str:
    """Where a daemon listens for engines when nothing else is configured.

    ``$KVXFER_SOCKET`` if set, else ``$XDG_RUNTIME_DIR/kvxfer/kvxferd.sock``, else
    ``/tmp/kvxfer-<uid>/kvxferd.sock``. Packaged deployments set ``/run/kvxfer/kvxferd.sock``.
    """
    explicit = os.environ.get("KVXFER_SOCKET")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "kvxfer", "kvxferd.sock")
    return f"/tmp/kvxfer-{os.getuid()}/kvxferd.sock"


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
