"""Who a peer may say it is: with mTLS, the daemon id it claims must be named by its certificate.

Every daemon id a peer sends (its Hello, a transfer's ``receiver_daemon_id``, an announced
push, a tier request) picks state kept for that daemon: its UCX endpoint, its pushes, its
permission to read this node's tier. Over mTLS any certificate of the cluster's CA gets a peer
in, so the id is bound to the certificate: it must be one of the certificate's
subjectAltName entries or its common name (issue each daemon a certificate naming its
``daemon_id``). A mismatch is PERMISSION_DENIED. Without TLS there is no identity to bind (the
network is the trust boundary, as the deployment docs say).
"""

from __future__ import annotations

from typing import Any

from kvxfer.errors import PermissionDeniedError

__all__ = ["PeerCertificate"]

_NAME_KEYS = ("x509_subject_alternative_name", "x509_common_name")


class PeerCertificate:
    """The names the caller's certificate carries (None: the call is not over mTLS)."""

    def __init__(self, context: Any, tls: bool) -> None:
        self.names: frozenset[str] | None = None
        if tls:
            auth = context.auth_context() or {}
            self.names = frozenset(v.decode(errors="replace") for k in _NAME_KEYS for v in auth.get(k, ()))

    def check(self, daemon_id: str) -> str:
        """``daemon_id`` if the certificate names it (or there is no certificate to ask)."""
        if self.names is not None and daemon_id not in self.names:
            shown = ", ".join(sorted(self.names)[:8]) or "none"
            raise PermissionDeniedError(
                f"the peer's certificate does not name daemon id {daemon_id[:100]!r} (it names: {shown[:300]}): "
                "issue each daemon a certificate whose subjectAltName or CN is its daemon_id"
            )
        return daemon_id
