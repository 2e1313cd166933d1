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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvxfer.defaults import default_socket_path

__all__ = ["Settings", "load_settings"]

_MiB = 1 << 20


def _setting(default: Any = None, help: str = "", *, factory: Callable[[], Any] | None = None) -> Any:
    """A :class:`Settings` field whose ``help`` text ``kvxferd --help`` shows."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Settings:
    """Everything kvxferd can be told; the defaults run a working daemon."""

    engine_socket: str = _setting(
        factory=default_socket_path, help="Unix socket for engines (EngineService) and local operators (AdminService)."
    )
    peer_listen: str = _setting("127.0.0.1:7461", "host:port of PeerService (other daemons); port 0 picks a free port.")
    peer_advertise: str = _setting("", "host:port other daemons use to reach this one; empty: peer_listen.")
    admin_listen: str = _setting("127.0.0.1:7462", "host:port of AdminService over TCP; empty disables it.")
    engine_socket_group: str = _setting(
        "", "Group owning the engine socket (mode 0660): engines in it may connect. Empty: the daemon's own."
    )
    tls_cert: str = _setting("", "mTLS on the TCP listeners and towards peers: PEM certificate (with key and CA).")
    tls_key: str = _setting("", "mTLS: PEM private key of tls_cert.")
    tls_ca: str = _setting("", "mTLS: PEM CA that peer and operator certificates must chain to.")
    metrics_listen: str = _setting(
        "127.0.0.1:7463", "host:port serving Prometheus metrics on /metrics; empty disables it."
    )
    daemon_id: str = _setting("", "Stable id of this daemon in tickets and logs; generated when empty.")
    default_lease_s: float = _setting(30.0, "Lease of an offer when the engine asks for none.")
    max_lease_s: float = _setting(3600.0, "Longest lease an engine may ask for.")
    pull_timeout_s: float = _setting(60.0, "Deadline of a pull when the engine gives none.")
    peer_timeout_s: float = _setting(
        5.0, "Deadline of each control message to a peer (Hello, transfer handshake steps)."
    )
    offer_wait_s: float = _setting(
        2.0,
        "How long a pull waits for an offer not made yet, under an id the engine chose in advance "
        "(its ticket went out before the offer); at most half of peer_timeout_s is used.",
    )
    max_offers: int = _setting(100_000, "Most offers held at once; more are refused with RESOURCE_EXHAUSTED.")
    # Layer-wise streaming pays a message and a chunk boundary per layer: worth it once the
    # transfer takes longer than that. SGLang measured per-layer-group pipelining at +18% TTFT
    # for 256-token prompts (32 MiB of Llama-8B KV) and -61% at 1K tokens (128 MiB).
    layerwise_min_bytes: int = _setting(
        64 * _MiB, "Transfers of a layer-by-layer offer smaller than this wait for every layer and go whole."
    )
    layerwise_batch_bytes: int = _setting(
        4 * _MiB, "A layer-wise transfer sends written layers once this much is waiting (or the last one is)."
    )
    # Bigger chunks amortise UCX's per-message handshake; smaller ones fill the pipeline
    # sooner. Of 2, 4, 8 and 32 MiB, 8 MiB moved b16 host handoffs fastest on the dev VM.
    chunk_bytes: int = _setting(8 * _MiB, "Bytes of one pipelined chunk on the UCX path (= one staging buffer).")
    window: int = _setting(8, "Chunks of one transfer in flight at once.")
    staging_bytes: int = _setting(64 * _MiB, "Host staging memory for sending, and the same again for receiving.")
    local_chunk_bytes: int = _setting(16 * _MiB, "Chunk of the local (same-daemon) host copy path.")
    gpu_chunk_bytes: int = _setting(
        64 * _MiB, "Bytes of one chunk when a GPU pool sends or receives over UCX (= one GPU staging buffer)."
    )
    gpu_staging_bytes: int = _setting(
        256 * _MiB, "GPU staging memory per GPU for sending, and the same again for receiving."
    )
    copy_threads: int = _setting(2, "Threads running local host copies; one handoff's chunks are dealt to all of them.")
    local_single_pass: bool = _setting(
        True,
        "Local host copies between two fragmented sides in one pass, by the kernel (process_vm_readv on the "
        "daemon itself); off, or where the kernel refuses it: numpy gather and scatter through scratch. Turn "
        "off where a seccomp profile or kernel audits or slows process_vm_readv on the daemon itself.",
    )
    ucx_error_handling: str = _setting(
        "auto",
        'UCX endpoint error handling: "auto" (off towards a peer on this host, so UCX may use shared memory and CMA; '
        'on otherwise), "on" or "off". "on" everywhere trades same-host speed for endpoints that report a dead '
        'peer; "off" everywhere lets UCX pick any transport, for fabrics where error handling disables the fast one.',
    )
    ucx_iov_receive: bool = _setting(
        True,
        "Receive fragmented chunks straight into the pool with UCP IOV receives; off: into staging, then unpack "
        "(as with UCXX's thread progress mode). Turn off for a UCX build or transport that mishandles IOV messages.",
    )
    ucx_iov_send: bool = _setting(
        True,
        "Send fragmented chunks straight from the pool with UCP IOV sends; off: pack each into staging first (as "
        "with UCXX's thread progress mode). Turn off for a UCX build or transport that mishandles IOV messages.",
    )
    same_host_direct_read: bool = _setting(
        True,
        "Between daemons on one host, the decode daemon reads offered host blocks straight from the offering "
        "daemon's memory (process_vm_readv) once a probe proves it may; the offering daemon then does no work "
        "per byte. Off, or where the probe fails: UCX's shared-memory transport. Turn off where policy forbids "
        "one daemon reading another's memory even when the kernel allows it.",
    )
    # UCX over TCP moves a large message over one connection (1.2 GB/s here for 256 MiB);
    # several connections at once, one thread each, go faster where the host has the cores.
    tcp_lanes: str = _setting(
        "auto",
        "Host blocks to a peer over TCP lanes (several TCP connections at once, one thread each): auto (when "
        "UCX would use TCP to that peer: no shared memory or RDMA in common), always (every remote pull between "
        "host pools that is not a direct read) or off.",
    )
    tcp_lane_count: int = _setting(4, "TCP connections (and threads) one transfer over TCP lanes uses, 1 to 16.")
    tcp_lanes_listen: str = _setting(
        "", "host:port the lanes of transfers this daemon serves connect to; empty: peer_listen's host, a free port."
    )
    tier_host_bytes: int = _setting(
        0, "Host memory of the node's KV tier (TierStore/TierLookup/TierLoad); 0: the tier is off."
    )
    tier_disk_dir: str = _setting(
        "", "Directory of the KV tier's disk below host memory (NVMe); empty: chunks evicted from memory are dropped."
    )
    tier_disk_bytes: int = _setting(0, "Bytes the KV tier may keep in tier_disk_dir (needed with tier_disk_dir).")
    tier_high_watermark: float = _setting(
        0.95, "A store that would fill the tier past this share of tier_host_bytes evicts first."
    )
    tier_low_watermark: float = _setting(
        0.85, "Evictions free the tier down to this share of tier_host_bytes (least recently used first)."
    )
    ucx_enabled: bool = _setting(
        True, "The UCX data plane; off, the daemon serves the local path only (its peer port reports NOT_SERVING)."
    )
    # Checksums cost a pass over what they cover on each side: a few bounded windows per
    # transfer catch a systematic fault (a block reused too early, a broken path) within a few
    # transfers at under 1% of the transfer, whatever the layout; every byte (full) costs two
    # more passes over a request.
    integrity: str = _setting(
        "sampled",
        "Block checksums, taken when an offer is written and checked at the source once sent and where the "
        "blocks land: off, sampled (integrity_samples windows of at most 64 KiB spread over each offer) or full "
        "(every byte).",
    )
    integrity_samples: int = _setting(
        8,
        "Windows per offer the sampled integrity mode checks: the offer's bytes cut into this many equal parts, "
        "one window of at most 64 KiB (or the segment it starts in, if smaller) at a random byte of each.",
    )
    registry: str = _setting(
        "",
        "The fleet registry: etcd://host:port[,host:port...] (etcds:// for TLS with the tls_* files). Each daemon "
        "keeps its record there under a lease and watches the others'. Empty: no registry; peers by ticket address.",
    )
    cluster: str = _setting("default", "Cluster name: the registry key prefix /kvxfer/<cluster>/daemons/.")
    registry_ttl_s: int = _setting(
        10, "Lease of this daemon's registry record: a daemon that stops renewing it leaves the fleet this much later."
    )
    drain_grace_s: float = _setting(10.0, "Seconds SIGTERM waits for running transfers before cancelling them.")
    history: int = _setting(1000, "Finished transfers kept for kvxferctl.")
    log_level: str = _setting("info", "Least severe log level written: debug, info, warning or error.")
    log_json: bool = _setting(False, "Write each log line as one JSON object instead of key=value pairs.")
    ready_file: str = _setting("", "Write {daemon_id, addresses, pid} as JSON here once every listener is up.")
    fault_injection: bool = _setting(
        False, "Testing only: accept the fault points given in `faults`. Off, any `faults` is refused at start."
    )
    faults: str = _setting(
        "", "Testing only (needs fault_injection): 'point=action;...' pauses or failures at named points (_faults.py)."
    )

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
        if self.faults and not self.fault_injection:
            raise ValueError("faults are given but fault_injection is off: fault points are for tests only")
        if self.faults:
            from ._faults import Faults

            Faults.parse(self.faults)
        for name in ("pull_timeout_s", "peer_timeout_s", "drain_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.offer_wait_s < 0:
            raise ValueError("offer_wait_s must not be negative")
        if self.integrity not in ("off", "sampled", "full"):
            raise ValueError("integrity must be off, sampled or full")
        if self.integrity_samples < 1:
            raise ValueError("integrity_samples must be >= 1")
        if self.tcp_lanes not in ("auto", "always", "off"):
            raise ValueError("tcp_lanes must be auto, always or off")
        if self.tier_host_bytes < 0 or not 0 < self.tier_low_watermark <= self.tier_high_watermark <= 1:
            raise ValueError("tier_host_bytes must be >= 0 and 0 < tier_low_watermark <= tier_high_watermark <= 1")
        if bool(self.tier_disk_dir) != (self.tier_disk_bytes > 0) or (self.tier_disk_dir and not self.tier_host_bytes):
            raise ValueError("tier_disk_dir and tier_disk_bytes go together, and with tier_host_bytes")
        if self.registry:
            from kvxfer.fleet import RegistryUrl, check_advertised, check_cluster_name

            url = RegistryUrl.parse(self.registry)
            check_cluster_name(self.cluster)
            if not 2 <= self.registry_ttl_s <= 3600:
                raise ValueError("registry_ttl_s must be in 2..3600")
            check_advertised(self.peer_advertise or self.peer_listen, url)
            if self.daemon_id and ("/" in self.daemon_id or len(self.daemon_id) > 200):
                raise ValueError("with a registry, daemon_id must be at most 200 characters and hold no '/'")
        if not 1 <= self.tcp_lane_count <= 16:
            raise ValueError("tcp_lane_count must be in 1..16")

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
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        name, kind = f.name, _fields()[f.name]
        flag = "--" + name.replace("_", "-")
        shown = getattr(defaults, name)
        help_text = f"{f.metadata['help']} [default: {shown!r}; env KVXFERD_{name.upper()}]"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=kind.__name__.upper(), help=help_text)
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
