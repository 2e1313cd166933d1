"""kvxferctl: look at (and steer) one kvxferd through its AdminService.

    kvxferctl status                 # the local daemon, over its Unix socket
    kvxferctl --addr host:7462 peers # a daemon's admin TCP port
    kvxferctl --json transfers --all # machine-readable
    kvxferctl transfers --watch      # live view, refreshed every second
    kvxferctl health                 # exit 0 when serving; else 1, naming what is not (draining,
                                     # no data plane for remote handoffs)
    kvxferctl fleet --registry etcd://h:2379 --cluster prod   # every daemon of a cluster

A remote daemon with mTLS needs --tls-cert, --tls-key and --tls-ca (or KVXFER_TLS_CERT,
KVXFER_TLS_KEY, KVXFER_TLS_CA); cancel and drain are accepted over the Unix socket or mTLS only.

Exit codes: 0 success, 1 the daemon answered with an error (or is not serving), 2 usage error,
3 daemon unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvxfer.defaults import channel_options, default_socket_path
from kvxfer.host_memory import MEMORY_KIND_NAMES
from kvxfer.proto import admin_pb2, admin_pb2_grpc
from kvxfer.tls import TlsFiles
from kvxfer.version import PROTOCOL_VERSION, __version__

from . import _ctl_views as views
from ._ctl_fleet import run_fleet
from ._ctl_views import human_bytes as size

EXIT_OK, EXIT_ERROR, EXIT_UNREACHABLE = 0, 1, 3  # 2: usage (argparse's own)


class Ctl:
    """Rows for scripts: raw numbers in base units (bytes, seconds, unix times); :data:`~._ctl_views.SHOW`
    turns them into the table's strings."""

    def __init__(
        self, stub: admin_pb2_grpc.AdminServiceStub, timeout_s: float, health: health_pb2_grpc.HealthStub
    ) -> None:
        self.stub = stub
        self.timeout_s = timeout_s
        self.health = health

    def call(self, name: str, request: Any) -> Any:
        return getattr(self.stub, name)(request, timeout=self.timeout_s)

    def pools(self) -> list[dict[str, Any]]:
        return [
            {
                "pool": p.pool_id,
                "name": p.name,
                "engine": p.engine_name or p.session_id,
                "memory": MEMORY_KIND_NAMES.get(p.kind, "unknown"),
                "device": p.device or "cpu",
                "blocks": p.num_blocks,
                "regions": p.regions,
                "buffers": p.buffers,
                "bytes": p.bytes,
                "offers": p.active_offers,
                "fingerprint": p.fingerprint,
            }
            for p in self.call("ListPools", admin_pb2.ListPoolsRequest()).pools
        ]

    def offers(self) -> list[dict[str, Any]]:
        return [
            {
                "offer": o.offer_id,
                "pool": o.pool_id,
                "blocks": o.num_blocks,
                "bytes": o.bytes,
                "state": o.state,
                "lease_left_s": round(o.lease_remaining_s, 3),
            }
            for o in self.call("ListOffers", admin_pb2.ListOffersRequest()).offers
        ]

    def transfers(self, include_finished: bool) -> list[dict[str, Any]]:
        resp = self.call("ListTransfers", admin_pb2.ListTransfersRequest(include_finished=include_finished))
        return [
            {
                "transfer": t.transfer_id,
                "role": t.role,
                "path": views.path(t.path),
                "transport": t.transport,
                "state": views.state(t.state),
                "bytes": t.bytes,
                "duration_s": t.duration_s,
                "gb_per_s": round(t.bytes / t.duration_s / 1e9, 3) if t.duration_s > 0 else None,
                "started_unix": t.started_unix,
                "offer": t.offer_id,
                "peer": t.peer_daemon_id,
                "mapping": t.mapping,
                "mode": t.mode,
                "mode_reason": t.mode_reason,
                "integrity": views.integrity(t),
                "integrity_mode": t.integrity_mode,
                "integrity_blocks": t.integrity_blocks,
                "integrity_result": t.integrity_result,
                "detail": t.detail,
            }
            for t in resp.transfers
        ]

    def tier(self) -> tuple[admin_pb2.ListTierResponse, list[dict[str, Any]]]:
        resp = self.call("ListTier", admin_pb2.ListTierRequest())
        rows = [
            {
                "namespace": t.namespace,
                "label": t.label,
                "chunks": t.chunks,
                "bytes": t.bytes,
                "hits": t.hits,
                "misses": t.misses,
                "hit_rate": round(t.hits / (t.hits + t.misses), 3) if t.hits + t.misses else None,
                "evictions": t.evictions,
                "disk_chunks": t.disk_chunks,
                "disk_bytes": t.disk_bytes,
                "disk_hits": t.disk_hits,
                "disk_evictions": t.disk_evictions,
                "disk_failures": t.disk_failures,
            }
            for t in resp.namespaces
        ]
        return resp, rows

    def peers(self) -> list[dict[str, Any]]:
        return [
            {
                "peer": p.daemon_id,
                "address": p.address,
                "host": p.hostname,
                "state": p.state,
                "version": p.version,
                "transports": list(p.ucx_transports),
                "last_hello_unix": p.last_hello_unix,
                "hello_age_s": round(time.time() - p.last_hello_unix, 1),
            }
            for p in self.call("ListPeers", admin_pb2.ListPeersRequest()).peers
        ]


def run(args: argparse.Namespace, ctl: Ctl) -> int:
    if args.command == "status":
        s = ctl.call("Status", admin_pb2.StatusRequest())
        if args.json:
            print(
                json.dumps(
                    {
                        "status": {**views.fields(s), "state": "draining" if s.draining else "serving"},
                        "pools": ctl.pools(),
                        "offers": ctl.offers(),
                        "peers": ctl.peers(),
                        "transfers": ctl.transfers(include_finished=False),
                    }
                )
            )
            return EXIT_OK
        print(f"daemon      {s.daemon_id} (kvxfer {s.version}, pid {s.pid}, host {s.hostname})")
        print(f"state       {'draining' if s.draining else 'serving'}, up {s.uptime_s:.0f}s")
        print(
            f"listeners   engine unix:{s.engine_socket}  peer {s.peer_address}  admin {s.admin_address or '-'}"
            f"  lanes {s.lanes_address or '-'}"
        )
        print(
            f"ucx         {','.join(s.ucx_transports) or 'unavailable'}; {s.ucx_endpoints} endpoints, "
            f"{s.ucx_receives_unconfirmed} receives unconfirmed"
        )
        registry = f"{s.registry_state} in {s.registry} (cluster {s.cluster}, {s.registry_nodes} daemons)"
        print(f"registry    {registry if s.registry else 'off'}{': ' + s.registry_detail if s.registry_detail else ''}")
        print(
            f"totals      {s.transfers_succeeded} transfers ok, {s.transfers_failed} failed, "
            f"{size(s.bytes_moved)} moved, {s.lease_expiries} leases expired"
        )
        print()
        views.show_rows(args, f"pools ({s.pools}, {size(s.registered_bytes)})", ctl.pools(), views.POOL_COLUMNS)
        print()
        views.show_rows(args, f"offers ({s.active_offers})", ctl.offers(), views.OFFER_COLUMNS)
        print()
        views.show_rows(args, f"peers ({s.peers})", ctl.peers(), views.PEER_COLUMNS)
        print()
        views.show_rows(args, f"transfers ({s.active_transfers} running)", ctl.transfers(False), views.TRANSFER_COLUMNS)
        return EXIT_OK
    if args.command == "pools":
        views.show_rows(args, "", ctl.pools(), views.POOL_COLUMNS)
    elif args.command == "offers":
        views.show_rows(args, "", ctl.offers(), views.OFFER_COLUMNS)
    elif args.command == "peers":
        views.show_rows(args, "", ctl.peers(), views.PEER_COLUMNS)
    elif args.command == "tier" and args.events:
        for n, batch in enumerate(ctl.stub.WatchTier(admin_pb2.WatchTierRequest()), 1):
            print(json.dumps(views.tier_batch(batch)), flush=True)
            if n == args.count:
                break
    elif args.command == "tier":
        resp, rows = ctl.tier()
        if args.json:
            print(json.dumps({**views.fields(resp), "namespaces": rows}))
        elif not resp.limit_bytes:
            print("the KV tier is off (tier_host_bytes is 0)")
        else:
            title = f"host tier: {size(resp.used_bytes)} of {size(resp.limit_bytes)}"
            if resp.disk_limit_bytes:
                title += f"; disk: {size(resp.disk_used_bytes)} of {size(resp.disk_limit_bytes)}"
            views.show_rows(args, title, rows, views.TIER_COLUMNS)
    elif args.command == "transfers" and args.watch:
        return _watch(args, ctl)
    elif args.command == "transfers":
        views.show_rows(args, "", ctl.transfers(args.all), views.TRANSFER_COLUMNS)
    elif args.command == "health":
        return _health(args, ctl)
    elif args.command == "cancel":
        resp = ctl.call("Cancel", admin_pb2.AdminCancelRequest(id=args.id))
        print(json.dumps({"cancelled": resp.cancelled, "detail": resp.detail}) if args.json else resp.detail)
        return EXIT_OK if resp.cancelled else EXIT_ERROR
    elif args.command == "drain":
        ctl.call("Drain", admin_pb2.DrainRequest())
        print(json.dumps({"draining": True}) if args.json else "draining")
    return EXIT_OK


def _health(args: argparse.Namespace, ctl: Ctl) -> int:
    """The daemon's health, and each part that is not serving, named. Exit 0 only when every
    part serves: the daemon (engines' calls; not while draining) and the data plane (remote
    handoffs)."""
    resp = ctl.health.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=ctl.timeout_s)
    daemon = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if args.service:
        print(json.dumps({"status": daemon}) if args.json else daemon.lower())
        return EXIT_OK if daemon == "SERVING" else EXIT_ERROR
    s = ctl.call("Status", admin_pb2.StatusRequest())
    parts = {"daemon": daemon, "data_plane": "SERVING" if s.data_plane_serving else "NOT_SERVING"}
    problems = []
    if s.draining:
        problems.append("daemon: draining")
    elif daemon != "SERVING":
        problems.append(f"daemon: {daemon.lower()}")
    if not s.data_plane_serving:
        problems.append(f"data plane (remote handoffs): {s.data_plane_detail or 'not serving'}")
    status = "SERVING" if not problems else ("NOT_SERVING" if daemon != "SERVING" else "DEGRADED")
    if args.json:
        print(json.dumps({"status": status, "parts": parts, "problems": problems}))
    else:
        print(status.lower() + "".join(f"\n  {p}" for p in problems))
    return EXIT_OK if not problems else EXIT_ERROR


def _watch(args: argparse.Namespace, ctl: Ctl) -> int:
    """Redraw running (and, with --all, recent) transfers every ``--interval`` seconds."""
    shown = 0
    try:
        while args.count == 0 or shown < args.count:
            rows = ctl.transfers(args.all)
            if args.json:
                print(json.dumps({"ts": round(time.time(), 3), "transfers": rows}), flush=True)
            else:
                if sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")  # home + clear: a live view, not a scroll
                print(f"{time.strftime('%H:%M:%S')}  transfers ({len(rows)})")
                print(views.table(views.shown(rows), views.TRANSFER_COLUMNS), flush=True)
            shown += 1
            if args.count == 0 or shown < args.count:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxferctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvxferctl {__version__} (protocol {PROTOCOL_VERSION})")
    parser.add_argument("--socket", help=f"daemon Unix socket (default {default_socket_path()})")
    parser.add_argument("--addr", help="daemon admin address host:port (instead of the socket)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default 5)")
    parser.add_argument("--tls-cert", default=os.environ.get("KVXFER_TLS_CERT", ""), help="client certificate (PEM)")
    parser.add_argument("--tls-key", default=os.environ.get("KVXFER_TLS_KEY", ""), help="client key (PEM)")
    parser.add_argument("--tls-ca", default=os.environ.get("KVXFER_TLS_CA", ""), help="CA of the daemon (PEM)")
    # --json also after the subcommand (kvxferctl offers --json); SUPPRESS keeps the value
    # given before it when the subcommand has none.
    json_anywhere = argparse.ArgumentParser(add_help=False)
    json_anywhere.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("status", "the daemon, its pools, offers, peers and running transfers"),
        ("pools", "registered pools"),
        ("offers", "live offers"),
        ("peers", "peer daemons"),
    ):
        sub.add_parser(name, help=help_text, parents=[json_anywhere])
    tier = sub.add_parser(
        "tier", help="the node's KV tier: use, hit rate and evictions per namespace", parents=[json_anywhere]
    )
    tier.add_argument(
        "--events", action="store_true", help="follow keys stored and removed, one JSON line per batch (Ctrl-C stops)"
    )
    tier.add_argument("--count", type=int, default=0, help="with --events: stop after this many batches")
    t = sub.add_parser("transfers", help="running transfers", parents=[json_anywhere])
    t.add_argument("--all", action="store_true", help="include recently finished transfers")
    t.add_argument("--watch", action="store_true", help="keep refreshing (Ctrl-C stops)")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    t.add_argument("--count", type=int, default=0, help="with --watch: stop after this many refreshes")
    h = sub.add_parser("health", help="gRPC health of the daemon: exit 0 when serving", parents=[json_anywhere])
    h.add_argument("--service", default="", help="a service name (default: the whole daemon)")
    c = sub.add_parser("cancel", help="cancel a transfer or release an offer", parents=[json_anywhere])
    c.add_argument("id")
    sub.add_parser("drain", help="stop taking offers and pulls, finish what runs, exit", parents=[json_anywhere])
    f = sub.add_parser("fleet", help="every daemon of a cluster, from the etcd registry", parents=[json_anywhere])
    f.add_argument("--registry", default=os.environ.get("KVXFERD_REGISTRY", ""), help="etcd://host:port[,...]")
    f.add_argument("--cluster", default=os.environ.get("KVXFERD_CLUSTER", "default"), help="cluster name")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "fleet":
        try:
            files = TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca)
        except ValueError as exc:
            parser.error(str(exc))
        raise SystemExit(run_fleet(args, files))
    target = args.addr if args.addr else "unix:" + (args.socket or default_socket_path())
    try:
        tls = TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca) if args.addr else None
    except ValueError as exc:
        parser.error(str(exc))
    channel = (
        grpc.secure_channel(target, tls.channel_credentials(), options=channel_options())
        if tls is not None
        else grpc.insecure_channel(target, options=channel_options())
    )
    with channel:
        ctl = Ctl(admin_pb2_grpc.AdminServiceStub(channel), args.timeout, health_pb2_grpc.HealthStub(channel))
        try:
            code = run(args, ctl)
            sys.stdout.flush()
        except BrokenPipeError:
            # The reader went away (kvxferctl status | head -1): not an error of ours. Point
            # stdout at /dev/null so the interpreter's own flush at exit stays quiet too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code = EXIT_OK
        except grpc.RpcError as exc:
            status = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            print(f"kvxferctl: {target}: {details}", file=sys.stderr)
            code = (
                EXIT_UNREACHABLE
                if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                else EXIT_ERROR
            )
    raise SystemExit(code)


if __name__ == "__main__":
    main()
