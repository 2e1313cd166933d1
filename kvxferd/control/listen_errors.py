"""Why a listener could not start, in words an operator can act on.

gRPC reports a failed bind as ``RuntimeError: Failed to bind to address unix:...`` and nothing
more; a daemon that dies with that names neither the cause nor the fix. :func:`check_unix_dir`
looks at a Unix socket's directory before binding, and :func:`explain` turns whatever a bind
raised into a :class:`ListenError` naming the listener, its address, the reason and the fix.

>>> err = explain("peer", "10.0.0.1:7461", OSError(98, "Address already in use"))
>>> err.reason, "another process listens" in err.fix
('address in use', True)
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
import stat

__all__ = ["ListenError", "check_unix_dir", "explain"]


class ListenError(Exception):
    """A listener that cannot start: which one, where, why, and what to do."""

    def __init__(self, listener: str, address: str, reason: str, fix: str) -> None:
        super().__init__(f"{listener} listener on {address}: {reason}: {fix}")
        self.listener = listener
        self.address = address
        self.reason = reason
        self.fix = fix


def _owner(path: str) -> str:
    st = os.stat(path)
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group} mode {stat.S_IMODE(st.st_mode):04o}"


def check_unix_dir(listener: str, path: str) -> None:
    """Make sure the directory of socket ``path`` exists (created when its parent allows) and
    that this process may create a socket in it; ListenError otherwise."""
    directory = os.path.dirname(os.path.abspath(path))
    address = "unix:" + path
    try:
        os.makedirs(directory, exist_ok=True)
    except PermissionError:
        parent = os.path.dirname(directory)
        raise ListenError(
            listener,
            address,
            "missing directory",
            f"{directory} does not exist and uid {os.geteuid()} may not create it in {parent} "
            f"({_owner(parent) if os.path.exists(parent) else 'missing too'}): create it, owned by the daemon's user",
        ) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ListenError(
            listener,
            address,
            "permission denied",
            f"uid {os.geteuid()} may not create a socket in {directory} ({_owner(directory)}): make the "
            "directory writable by the daemon's user (deploy/kubernetes prepares it in an init container; "
            "systemd's RuntimeDirectory= does it for the unit)",
        )


def explain(listener: str, address: str, exc: BaseException) -> ListenError:
    """The ListenError for a bind of ``address`` that raised ``exc``. gRPC's own failure carries
    no errno: then the address is bound once more with a plain socket to learn why."""
    if isinstance(exc, ListenError):
        return exc
    code = exc.errno if isinstance(exc, OSError) else _probe(address)
    if code in (errno.EACCES, errno.EPERM):
        return ListenError(
            listener, address, "permission denied", "ports below 1024 need CAP_NET_BIND_SERVICE; pick another port"
        )
    if code == errno.EADDRINUSE:
        return ListenError(
            listener,
            address,
            "address in use",
            "another process listens there (a second kvxferd?): stop it or pick another port",
        )
    if code == errno.EADDRNOTAVAIL:
        return ListenError(
            listener, address, "address not on this host", "listen on an address of this host, or 0.0.0.0"
        )
    if code == errno.ENOENT:
        return ListenError(listener, address, "missing directory", "create the socket's directory")
    return ListenError(listener, address, "cannot listen", str(exc) or repr(exc))


def _probe(address: str) -> int | None:
    """The errno a plain bind of ``address`` gets (None when it binds fine, or for Unix sockets)."""
    if address.startswith("unix:"):
        return None
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(port)))
        except OSError as exc:
            return exc.errno
        except ValueError:
            return None
    return None
