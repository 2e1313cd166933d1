"""Mutual TLS for the TCP listeners (PeerService, AdminService) and their clients.

Give all three files or none: a certificate and key to present, and the CA that signed the
other side's certificate. Once configured, a daemon refuses plaintext connections and
certificates from any other CA on its TCP ports, and dials its peers the same way.

>>> TlsFiles.from_paths("", "", "") is None
True
>>> TlsFiles.from_paths("cert.pem", "", "")
Traceback (most recent call last):
...
ValueError: mTLS needs a certificate, a key and a CA; missing: key, ca
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

__all__ = ["TlsFiles"]


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_paths(cls, cert: str, key: str, ca: str) -> TlsFiles | None:
        """Read the three PEM files; None when none is given (plaintext)."""
        given = {"cert": cert, "key": key, "ca": ca}
        if not any(given.values()):
            return None
        missing = [name for name, path in given.items() if not path]
        if missing:
            raise ValueError(f"mTLS needs a certificate, a key and a CA; missing: {', '.join(missing)}")
        contents = {}
        for name, path in given.items():
            try:
                with open(path, "rb") as fh:
                    contents[name] = fh.read()
            except OSError as exc:
                raise ValueError(f"cannot read TLS {name} {path}: {exc.strerror}") from None
        return cls(**contents)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: present our certificate, require one signed by the CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: trust only the CA, present our certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )
