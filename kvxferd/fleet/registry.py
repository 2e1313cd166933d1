"""This daemon in the cluster's etcd registry: its record under its own lease, and a watch of
everyone else's.

States (logged once per change, exported as ``kvxfer_registry_state`` and in ``Status``):

- ``connecting``: at start, before etcd first answered;
- ``registered``: our record is in etcd, our lease kept alive every ``ttl/3``;
- ``unreachable``: etcd did not answer; handoffs go on by the addresses in tickets, and the
  record is put again (on a new lease if the old one expired) once etcd answers;
- ``conflict``: another live daemon holds our id; we keep trying, in case it goes.

Registration is create-if-absent on the daemon id. A record left by a daemon of our id that
died on this host (its pid is gone) is taken over at once; any other is waited out for one
lease (a crashed daemon's record vanishes with its lease), then refused:
:class:`RegistryConflictError`, and the daemon does not start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import grpc
from etcd3aio import EtcdError, prefix_range_end

from kvxfer.errors import InvalidRequestError
from kvxfer.fleet import FleetRecord, RegistryUrl, accepted, cluster_prefix, etcd_client, list_records, record_key
from kvxfer.tls import TlsFiles

from .._config import Settings
from .._faults import Faults
from .._log import log_event
from .members import Members
from .view import RegistryView

__all__ = ["Registry", "RegistryConflictError", "RegistryView"]

#: Seconds a watch runs before the records are listed again (a safety net, see ``_follow``).
RELIST_S = 60.0
#: What etcd's client raises when etcd does not answer (or answers with an error).
_ETCD_DOWN = (EtcdError, grpc.RpcError, TimeoutError, OSError)


class RegistryConflictError(Exception):
    """Another live daemon is registered under this daemon's id."""


class Registry:
    def __init__(
        self,
        settings: Settings,
        tls: TlsFiles | None,
        record: FleetRecord,
        on_left: Callable[[str, str], None],
        faults: Faults,
    ) -> None:
        self.url = RegistryUrl.parse(settings.registry)
        self.cluster = settings.cluster
        self.ttl_s = settings.registry_ttl_s
        #: Each etcd call's deadline.
        self.op_timeout_s = max(1.0, min(settings.peer_timeout_s, self.ttl_s / 3))
        self.record = record
        self.members = Members(record.daemon_id)
        self._on_left = on_left
        self._faults = faults
        self._client = etcd_client(self.url, tls)
        self._key = record_key(self.cluster, record.daemon_id)
        self._lease = 0
        self.state, self.detail = "connecting", ""
        self._tasks: list[asyncio.Task[None]] = []

    def view(self) -> RegistryView:
        nodes = len(self.members.records) + (self.state == "registered")
        return RegistryView(str(self.url), self.cluster, self.state, self.detail, nodes)

    def address_of(self, daemon_id: str) -> str | None:
        return self.members.address_of(daemon_id)

    def left_why(self, daemon_id: str) -> str:
        return self.members.left_why(daemon_id)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Register (RegistryConflictError: our id is live elsewhere), then keep the lease and
        watch the others in the background. etcd unreachable is not an error here."""
        await self._client.connect()
        try:
            await self._register(wait_out=True)
        except _ETCD_DOWN as exc:
            self._set("unreachable", _why(exc))
        self._tasks = [
            asyncio.create_task(self._keep(), name="registry-lease"),
            asyncio.create_task(self._watch(), name="registry-watch"),
        ]

    async def close(self, deregister: bool) -> None:
        """Stop; ``deregister``: delete our record and revoke our lease first (a drain)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if deregister and self._lease:
            with contextlib.suppress(*_ETCD_DOWN):
                await self._client.lease.revoke(self._lease, timeout=min(2.0, self.op_timeout_s))  # type: ignore[union-attr]
                log_event("registry.deregistered", cluster=self.cluster, daemon_id=self.record.daemon_id)
        with contextlib.suppress(*_ETCD_DOWN):
            await self._client.close()

    # -- our record --------------------------------------------------------------------------

    async def _register(self, wait_out: bool) -> None:
        kv, lease = self._client.kv, self._client.lease
        assert kv is not None and lease is not None
        if not self._lease:
            self._lease = (await lease.grant(int(self.ttl_s), timeout=self.op_timeout_s)).ID
        value = self.record.to_json()
        waited = 0.0
        while True:
            resp = await kv.txn(
                [kv.txn_compare_create_revision(self._key, 0)],
                [kv.txn_op_put(self._key, value, lease=self._lease)],
                [kv.txn_op_get(self._key)],
                timeout=self.op_timeout_s,
            )
            if resp.succeeded:
                self._set("registered", f"lease {self._lease:x}, ttl {self.ttl_s:g}s")
                return
            kvs = resp.responses[0].response_range.kvs
            if not kvs:
                continue  # it went between the compare and the read: try again
            held = kvs[0].value
            # A record on no lease is no daemon's (it would outlive any): taken over too.
            if held == value or _holder_died_here(held) or not kvs[0].lease:
                if (
                    await kv.txn(
                        [kv.txn_compare_value(self._key, held)],
                        [kv.txn_op_put(self._key, value, lease=self._lease)],
                        timeout=self.op_timeout_s,
                    )
                ).succeeded:
                    self._set("registered", "took over the record of a daemon of this id that died on this host")
                    return
                continue
            if not wait_out or waited > self.ttl_s + 1:
                holder = _describe(held)
                self._set("conflict", f"daemon id {self.record.daemon_id!r} is registered by {holder}")
                raise RegistryConflictError(
                    f"daemon id {self.record.daemon_id!r} is already registered in cluster {self.cluster!r} by "
                    f"{holder}, which keeps its lease alive: give this daemon another daemon_id, or stop that one"
                )
            if waited == 0:
                log_event(
                    "registry.id_held",
                    logging.WARNING,
                    daemon_id=self.record.daemon_id,
                    by=_describe(held),
                    detail=f"waiting up to {self.ttl_s + 1:g}s for its lease to lapse",
                )
            await asyncio.sleep(0.5)
            waited += 0.5

    async def _keep(self) -> None:
        """Keep the lease alive; put the record again (on a new lease) when it was lost."""
        while True:
            await asyncio.sleep(self.ttl_s / 3 if self.state == "registered" else min(1.0, self.ttl_s / 3))
            try:
                if self._lease and not await self._refresh():
                    log_event("registry.lease_lost", logging.WARNING, lease=f"{self._lease:x}")
                    self._lease = 0
                if self.state != "registered" or not self._lease:
                    await self._register(wait_out=False)  # the record may have gone meanwhile
            except RegistryConflictError:
                continue  # logged by the state change; tried again next turn
            except _ETCD_DOWN as exc:
                self._set("unreachable", _why(exc))

    async def _refresh(self) -> bool:
        """One keep-alive of our lease: False when etcd says it expired."""
        assert self._client.lease is not None
        call: Any = self._client.lease.keep_alive(self._lease)
        try:
            async with asyncio.timeout(self.op_timeout_s):
                async for resp in call:
                    return bool(resp.TTL > 0)
            return False
        finally:
            call.cancel()

    # -- everyone else -----------------------------------------------------------------------

    async def _watch(self) -> None:
        """List the cluster's records, then follow them from that revision; list again after
        a compaction or a lost watch. A record that leaves is a daemon that left."""
        prefix = cluster_prefix(self.cluster)
        end = prefix_range_end(prefix)
        while True:
            try:
                listed, revision = await list_records(self._client, self.cluster, self.op_timeout_s)
                for item in listed:
                    if item.record is None and item.key_id != self.record.daemon_id:
                        log_event("registry.record_ignored", logging.WARNING, key=item.key_id[:100], detail=item.why)
                records = [item.record for item in listed if item.record is not None]
                for gone in self.members.replace(records):
                    self._left(gone, "its record was gone when the registry was listed again")
                await self._faults.hit("registry_watch")  # tests: compact etcd between list and watch
                await self._follow(prefix, end, revision + 1)
            except _ETCD_DOWN as exc:
                self._set("unreachable", _why(exc))
                await asyncio.sleep(min(1.0, self.ttl_s / 3))

    async def _follow(self, prefix: bytes, end: bytes, revision: int) -> None:
        """Apply the watch's events from ``revision`` until etcd says it compacted past it, or
        for RELIST_S at most: a compaction at exactly ``revision`` drops the tombstones of
        records deleted then, which no watch delivers, so the listing is redone now and then."""
        assert self._client.watch is not None
        try:
            async with asyncio.timeout(RELIST_S):
                async for resp in self._client.watch.watch(prefix, range_end=end, start_revision=revision):
                    if resp.canceled or resp.compact_revision:
                        log_event("registry.relist", detail=f"watch compacted past revision {revision}")
                        return
                    for event in resp.events:
                        self._apply(event)
        except TimeoutError:
            return

    def _apply(self, event: Any) -> None:
        daemon_id = event.kv.key[len(cluster_prefix(self.cluster)) :].decode(errors="replace")
        if event.type == 0 and daemon_id == self.record.daemon_id:
            if (event.kv.value, event.kv.lease) != (self.record.to_json(), self._lease) and self.state == "registered":
                self._restore(event.kv.value)
        elif event.type == 0:  # PUT
            try:
                self.members.put(accepted(self.cluster, event.kv.key, event.kv.value, event.kv.lease))
            except InvalidRequestError as exc:
                log_event("registry.record_ignored", logging.WARNING, key=daemon_id[:100], detail=str(exc))
        elif daemon_id == self.record.daemon_id:
            if self.state == "registered":  # someone deleted our record: put it back
                self._set("unreachable", "our record was deleted; putting it back")
        else:
            self._left(daemon_id, "its record left the registry (lease expired or drained)")

    def _restore(self, written: bytes) -> None:
        """Our record was overwritten while our lease lives: no daemon does that (a daemon of
        our id would have waited for our lease), so we put ours back over it at once."""
        log_event(
            "registry.record_overwritten", logging.WARNING, daemon_id=self.record.daemon_id, by=_describe(written)
        )
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(self._put_back(written), name="registry-restore"))

    async def _put_back(self, written: bytes) -> None:
        kv = self._client.kv
        assert kv is not None
        try:
            put = [kv.txn_op_put(self._key, self.record.to_json(), lease=self._lease)]
            if (await kv.txn([kv.txn_compare_value(self._key, written)], put, timeout=self.op_timeout_s)).succeeded:
                log_event("registry.record_restored", logging.WARNING, daemon_id=self.record.daemon_id)
        except _ETCD_DOWN as exc:
            self._set("unreachable", _why(exc))  # _keep puts it back once etcd answers

    def _left(self, daemon_id: str, why: str) -> None:
        if self.members.drop(daemon_id, why):
            log_event("registry.peer_left", logging.WARNING, peer=daemon_id, detail=why)
            self._on_left(daemon_id, why)

    def _set(self, state: str, detail: str) -> None:
        if state != self.state:
            level = logging.INFO if state == "registered" else logging.WARNING
            log_event("registry.state", level, state=state, was=self.state, registry=str(self.url), detail=detail)
        self.state, self.detail = state, detail


def _parsed(raw: bytes) -> FleetRecord | None:
    try:
        return FleetRecord.from_json(raw)
    except ValueError as exc:  # InvalidRequestError is one
        log_event("registry.record_ignored", logging.WARNING, detail=str(exc)[:200])
        return None


def _holder_died_here(raw: bytes) -> bool:
    record = _parsed(raw)
    if record is None or record.hostname != socket.gethostname():
        return False
    if record.pid <= 0 or record.pid == os.getpid():
        return record.pid > 0
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _describe(raw: bytes) -> str:
    record = _parsed(raw)
    return f"{record.peer_address} on {record.hostname}" if record is not None else "an unreadable record"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
