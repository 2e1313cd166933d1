"""Daemon settings: embedded defaults < YAML file < ``KVXFERD_*`` environment < CLI flags.

Every field of :class:`Settings` can be set in each of the three places: ``chunk_bytes`` is
``chunk_bytes:`` in YAML, ``KVXFERD_CHUNK_BYTES`` in the environment and ``--chunk-bytes`` on
the command line. The YAML file is named by ``--config`` or ``KVXFERD_CONFIG``.

>>> s = load_settings(argv=["--chunk-bytes", "1048576"], environ={"KVXFERD_WINDOW": "2"})
>>> s.chunk_bytes, s.window
(1048576, 2)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvxfer_client._config import default_socket_path

__all__ = ["Settings", "load_settings"]

_MiB = 1 << 20


@dataclass(frozen=True)
class Settings:
    """Everything kvxferd can be told; the defaults run a working daemon."""

    #: Unix socket for engines (EngineService) and local operators (AdminService).
    engine_socket: str = field(default_factory=default_socket_path)
    #: host:port of PeerService (other daemons). Port 0 picks a free port.
    peer_listen: str = "127.0.0.1:7461"
    #: host:port other daemons use to reach this one; defaults to peer_listen.
    peer_advertise: str = ""
    #: host:port of AdminService over TCP; empty disables it.
    admin_listen: str = "127.0.0.1:7462"
    #: Group owning the engine socket (mode 0660): engines in it may connect. Empty: ours.
    engine_socket_group: str = ""
    #: mTLS on the TCP listeners and towards peers: PEM certificate, key and CA (all or none).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    #: host:port serving Prometheus metrics on /metrics; empty disables it.
    metrics_listen: str = "127.0.0.1:7463"
    #: Stable id of this daemon in tickets and logs; generated when empty.
    daemon_id: str = ""
    #: Lease of an offer when the engine asks for none, and the longest one allowed.
    default_lease_s: float = 30.0
    max_lease_s: float = 3600.0
    #: Deadline of a pull when the engine gives none.
    pull_timeout_s: float = 60.0
    #: Deadline of each control message to a peer (Hello, transfer handshake steps).
    peer_timeout_s: float = 5.0
    #: Most offers held at once.
    max_offers: int = 100_000
    #: Bytes of one pipelined chunk on the UCX path (= one staging buffer). b16 remote on the
    #: 2-core dev VM, against a plain UCXX send: 0.80 with 2 MiB, 0.98 with 4, 1.07 with 8.
    chunk_bytes: int = 8 * _MiB
    #: Chunks of one transfer in flight at once.
    window: int = 8
    #: Staging memory for sending, and the same again for receiving.
    staging_bytes: int = 64 * _MiB
    #: Chunk of the local (same-daemon) copy path.
    local_chunk_bytes: int = 16 * _MiB
    #: Bytes of one chunk when a GPU pool sends or receives over UCX (= one GPU staging buffer).
    gpu_chunk_bytes: int = 64 * _MiB
    #: GPU staging memory per GPU for sending, and the same again for receiving.
    gpu_staging_bytes: int = 256 * _MiB
    #: Threads running memory copies (numpy releases the GIL while copying).
    copy_threads: int = 2
    #: UCX endpoint error handling: "auto" (off towards a peer on this host so UCX may use
    #: shared memory + CMA, on otherwise), "on" or "off".
    ucx_error_handling: str = "auto"
    #: Receive fragmented chunks straight into the pool with UCP IOV receives (needs UCXX's
    #: blocking or polling progress mode); off: receive into staging and unpack.
    ucx_iov_receive: bool = True
    #: Send fragmented chunks straight from the pool with UCP IOV sends (same progress-mode
    #: condition); off: pack each into staging first.
    ucx_iov_send: bool = True
    #: The UCX data plane; off, the daemon serves the local path only (and its peer port
    #: reports NOT_SERVING).
    ucx_enabled: bool = True
    #: Seconds SIGTERM waits for running transfers before cancelling them.
    drain_grace_s: float = 10.0
    #: Finished transfers kept for kvxferctl.
    history: int = 1000
    log_level: str = "info"
    log_json: bool = False
    #: Write {daemon_id, addresses, pid} as JSON here once every listener is up.
    ready_file: str = ""

    def validate(self) -> None:
        if self.chunk_bytes < 64 << 10 or self.chunk_bytes > 256 * _MiB:
            raise ValueError("chunk_bytes must be in 64 KiB..256 MiB")
        if self.window < 1 or self.copy_threads < 1:
            raise ValueError("window and copy_threads must be >= 1")
        if self.staging_bytes < self.chunk_bytes:
            raise ValueError("staging_bytes must hold at least one chunk")
        if not 64 << 10 <= self.gpu_chunk_bytes <= 256 * _MiB or self.gpu_staging_bytes < self.gpu_chunk_bytes:
            raise ValueError("gpu_chunk_bytes must be in 64 KiB..256 MiB and gpu_staging_bytes hold one")
        if self.ucx_error_handling not in ("auto", "on", "off"):
            raise ValueError("ucx_error_handling must be auto, on or off")
        if not 0 < self.default_lease_s <= self.max_lease_s:
            raise ValueError("need 0 < default_lease_s <= max_lease_s")
        tls = [bool(self.tls_cert), bool(self.tls_key), bool(self.tls_ca)]
        if any(tls) and not all(tls):
            raise ValueError("mTLS needs tls_cert, tls_key and tls_ca together")
        for name in ("pull_timeout_s", "peer_timeout_s", "drain_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _convert(name: str, kind: type, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}") from None


def _fields() -> dict[str, type]:
    kinds = {"str": str, "int": int, "float": float, "bool": bool}
    return {f.name: kinds[str(f.type)] for f in dataclasses.fields(Settings)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxferd",
        description="kvxfer node daemon: moves KV-cache blocks between serving engines.",
        epilog="Precedence: embedded defaults < YAML file < KVXFERD_* environment < flags.",
    )
    parser.add_argument("--config", help="YAML settings file (or KVXFERD_CONFIG)")
    parser.add_argument("--print-config", action="store_true", help="print the effective settings and exit")
    for name, kind in _fields().items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=kind.__name__.upper())
    return parser


def load_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Merge the four sources into validated :class:`Settings` (ValueError when invalid)."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(list(argv or []))
    fields = _fields()
    values: dict[str, Any] = {}
    config_path = args.config or environ.get("KVXFERD_CONFIG")
    if config_path:
        with open(config_path) as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{config_path}: expected a mapping of settings")
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name not in fields:
                raise ValueError(f"{config_path}: unknown setting {key!r}")
            values[name] = _convert(name, fields[name], value)
    for name, kind in fields.items():
        env = environ.get("KVXFERD_" + name.upper())
        if env is not None:
            values[name] = _convert("KVXFERD_" + name.upper(), kind, env)
    for name, kind in fields.items():
        flag = getattr(args, name)
        if flag is not None:
            values[name] = _convert("--" + name.replace("_", "-"), kind, flag)
    settings = Settings(**values)
    settings.validate()
    return settings
