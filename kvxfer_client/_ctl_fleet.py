"""``kvxferctl fleet``: every daemon of a cluster, from the etcd registry and each daemon's
AdminService.

    kvxferctl fleet --registry etcd://10.0.0.1:2379 --cluster prod
    kvxferctl --json fleet --registry etcd://10.0.0.1:2379

The registry says who is registered and where; each daemon's ``Status`` says what it holds
now (over mTLS with ``--tls-*``). A daemon that is registered but does not answer is shown
``unreachable``, with the error: it may be frozen, cut off, or about to lose its lease.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import grpc

from kvxfer.defaults import channel_options
from kvxfer.fleet import FleetRecord, Listed, RegistryUrl, check_cluster_name, etcd_client, list_records
from kvxfer.proto import admin_pb2, admin_pb2_grpc
from kvxfer.tls import TlsFiles

from ._ctl_views import human_bytes, printable, table

__all__ = ["fleet_rows", "run_fleet"]

COLUMNS = ("daemon", "address", "version", "state", "pools", "offers", "transfers", "tier", "registry")


async def _records(url: RegistryUrl, cluster: str, tls: TlsFiles | None, timeout_s: float) -> list[Listed]:
    client = etcd_client(url, tls)
    await client.connect()
    try:
        return (await list_records(client, cluster, timeout_s))[0]
    finally:
        await client.close()


async def _row(record: FleetRecord, tls: TlsFiles | None, timeout_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {
        "daemon": record.daemon_id,
        "address": record.peer_address,
        "admin_address": record.admin_address,
        "version": record.version,
        "host": record.hostname,
        "started_unix": record.started_at,
        "transports": list(record.transports),
        "capabilities": list(record.capabilities),
    }
    if not record.admin_address:
        return {**row, "state": "unreachable", "error": "no admin address in its record (admin_listen is off)"}
    target, options = record.admin_address, channel_options()
    channel = (
        grpc.aio.secure_channel(target, tls.channel_credentials(), options=options)
        if tls is not None
        else grpc.aio.insecure_channel(target, options=options)
    )
    async with channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        try:
            s = await stub.Status(admin_pb2.StatusRequest(), timeout=timeout_s)
            tier = await stub.ListTier(admin_pb2.ListTierRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            return {**row, "state": "unreachable", "error": details}
    if s.daemon_id != record.daemon_id:
        return {**row, "state": "mismatch", "error": f"{target} answers as {s.daemon_id!r}"}
    return {
        **row,
        "state": "draining" if s.draining else "serving",
        "pools": s.pools,
        "registered_bytes": s.registered_bytes,
        "offers": s.active_offers,
        "transfers": s.active_transfers,
        "tier_used_bytes": tier.used_bytes + tier.disk_used_bytes,
        "registry": s.registry_state,
        "data_plane": "serving" if s.data_plane_serving else s.data_plane_detail,
    }


async def fleet_rows(url: RegistryUrl, cluster: str, tls: TlsFiles | None, timeout_s: float) -> list[dict[str, Any]]:
    """One row per registered daemon, each asked for its ``Status`` at once; a key whose record
    no daemon could have written (``kvxfer.fleet.accepted``) is an ``ignored`` row, never asked."""
    listed = sorted(await _records(url, cluster, tls, timeout_s), key=lambda item: item.key_id)
    asked = await asyncio.gather(*(_row(i.record, tls, timeout_s) for i in listed if i.record is not None))
    rows = iter(asked)
    return [
        next(rows) if i.record is not None else {"daemon": i.key_id, "state": "ignored", "error": i.why} for i in listed
    ]


def run_fleet(args: argparse.Namespace, tls: TlsFiles | None) -> int:
    """Print the fleet; exit 0 when every registered daemon serves, 1 when one does not, 3
    when the registry does not answer. Keys no daemon could have written are shown, ignored."""
    try:
        url = RegistryUrl.parse(args.registry)
        check_cluster_name(args.cluster)
    except ValueError as exc:
        print(f"kvxferctl: {exc}")
        return 2
    try:
        rows = asyncio.run(fleet_rows(url, args.cluster, tls, args.timeout))
    except Exception as exc:  # noqa: BLE001 - etcd's client raises its own tree and gRPC's
        print(f"kvxferctl: registry {url} did not answer: {type(exc).__name__}: {exc}")
        return 3
    if args.json:
        print(json.dumps({"registry": str(url), "cluster": args.cluster, "daemons": rows}))
    else:
        up = sum(r["state"] == "serving" for r in rows)
        ignored = sum(r["state"] == "ignored" for r in rows)
        more = f", {ignored} key(s) ignored (no daemon could have written them)" if ignored else ""
        print(f"cluster {args.cluster} in {url}: {len(rows) - ignored} registered, {up} serving{more}")
        shown = [{**r, "tier": human_bytes(r.get("tier_used_bytes", 0))} for r in rows]
        # Records are anyone's writing: nothing of theirs reaches the terminal unescaped.
        shown = [{k: ("-" if v is None else printable(v)) for k, v in r.items()} for r in shown]
        print(table(shown, COLUMNS))
        for r in rows:
            if "error" in r:
                print(f"  {printable(r['daemon'])}: {printable(r['error'])}")
    return 0 if all(r["state"] in ("serving", "ignored") for r in rows) else 1
