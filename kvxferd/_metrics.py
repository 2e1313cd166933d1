"""Prometheus metrics of one daemon, served on ``metrics_listen`` (``/metrics``).

Events (a transfer ends, a lease expires, an offer is released) update counters and the
duration histogram as they happen; state (offers, transfers, pools, peers, staging) is read
at scrape time from a snapshot the event loop hands over, so it can never drift from what
``kvxferctl`` shows. Label values are bounded sets (path, transport, result, reason, memory
kind, device, peer state): never a request, offer or transfer id.

>>> from kvxferd._transfers import EndedTransfer
>>> m = Metrics()
>>> m.transfer_finished(EndedTransfer("decode", "local", "local-copy", "succeeded", "none", 4096, 0.002))
>>> labels = 'path="local",reason="none",result="succeeded",role="decode",transport="local-copy"'
>>> b"kvxfer_transfers_total{" + labels.encode() + b"} 1.0" in m.render()
True
"""

from __future__ import annotations

import http.server
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kvxfer.version import PROTOCOL_VERSION, __version__

from ._snapshot import NodeSnapshot
from ._transfers import EndedTransfer

__all__ = ["Metrics", "serve_metrics"]

#: Seconds: from sub-millisecond local copies to a minute-long pull of tens of GB.
DURATION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _StateCollector(Collector):
    """Gauges of the daemon's state, from one snapshot per scrape (None: no daemon, zeros)."""

    def __init__(self, snapshot: Callable[[], NodeSnapshot | None]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return []  # registered before the daemon's state exists: nothing to read yet

    def collect(self) -> Iterable[Metric]:
        s = self._snapshot() or NodeSnapshot(daemon_id="", draining=False)
        yield GaugeMetricFamily(
            "kvxfer_offers_active", "Offers holding blocks, waiting for a pull", value=s.offer_count
        )
        active = GaugeMetricFamily("kvxfer_transfers_active", "Transfers running now, by role", labels=["role"])
        by_role = s.transfers_by_role()
        for role in ("decode", "prefill"):
            active.add_metric([role], by_role.get(role, 0))
        yield active
        pools = GaugeMetricFamily(
            "kvxfer_pool_registered_bytes", "Bytes of registered KV pools", labels=["memory_kind", "device"]
        )
        for (kind, device), nbytes in sorted(s.pool_bytes().items()):
            pools.add_metric([kind, device], nbytes)
        yield pools
        peers = GaugeMetricFamily("kvxfer_peers", "Peer daemons known, by connection state", labels=["state"])
        counts = s.peers_by_state()
        for state in ("connected", "failed"):
            peers.add_metric([state], counts.get(state, 0))
        yield peers
        used = GaugeMetricFamily(
            "kvxfer_staging_bytes_in_use", "Staging buffer bytes leased to transfers", labels=["direction"]
        )
        made = GaugeMetricFamily(
            "kvxfer_staging_bytes_allocated",
            "Staging buffer bytes allocated so far (made on first need, then kept)",
            labels=["direction"],
        )
        cap = GaugeMetricFamily("kvxfer_staging_bytes_limit", "Staging buffer bytes allowed", labels=["direction"])
        for direction, st in sorted(s.staging.items()):
            used.add_metric([direction], st.in_use * st.buffer_bytes)
            made.add_metric([direction], st.allocated * st.buffer_bytes)
            cap.add_metric([direction], st.limit * st.buffer_bytes)
        yield used
        yield made
        yield cap
        tier_used = GaugeMetricFamily("kvxfer_tier_bytes", "Bytes of chunks the KV tier holds", labels=["tier"])
        tier_used.add_metric(["host"], s.tier_used_bytes)
        tier_used.add_metric(["disk"], s.tier_disk_used_bytes)
        yield tier_used
        tier_limit = GaugeMetricFamily("kvxfer_tier_limit_bytes", "Bytes the KV tier may hold", labels=["tier"])
        tier_limit.add_metric(["host"], s.tier_limit_bytes)
        tier_limit.add_metric(["disk"], s.tier_disk_limit_bytes)
        yield tier_limit
        lookups = CounterMetricFamily(
            "kvxfer_tier_lookup_blocks",
            "Keys looked up or loaded: stored (hit, by the tier that held it) or not (miss)",
            labels=["result", "tier"],
        )
        lookups.add_metric(["hit", "host"], sum(t.hits - t.disk_hits for t in s.tier))
        lookups.add_metric(["hit", "disk"], sum(t.disk_hits for t in s.tier))
        lookups.add_metric(["miss", "none"], sum(t.misses for t in s.tier))
        yield lookups
        evicted = CounterMetricFamily("kvxfer_tier_evictions", "Chunks evicted to make room", labels=["tier"])
        evicted.add_metric(["host"], sum(t.evictions for t in s.tier))
        evicted.add_metric(["disk"], sum(t.disk_evictions for t in s.tier))
        yield evicted
        yield CounterMetricFamily(
            "kvxfer_tier_disk_failures",
            "Chunks dropped because their disk write or read failed (or read back other bytes)",
            value=sum(t.disk_failures for t in s.tier),
        )
        yield GaugeMetricFamily(
            "kvxfer_ucx_receives_unconfirmed",
            "UCX receives cancelled but not confirmed ended (a killed same-host sender can leave them until "
            "restart): their destination memory is held back",
            value=s.ucx_receives_unconfirmed,
        )
        yield GaugeMetricFamily("kvxfer_serving", "1 while accepting work, 0 while draining", value=not s.draining)
        yield from _registry_gauges(s)
        info = InfoMetricFamily("kvxfer_build", "Version of this daemon")
        info.add_metric([], {"version": __version__, "protocol_version": str(PROTOCOL_VERSION)})
        yield info


#: Engine calls answer in microseconds (offer) to a minute (a long pull).
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30, 60)
#: Why a transfer failed: a bounded set (see ``failure_reason``).
REASONS = ("none", "refused", "expired", "deadline", "unavailable", "cancelled", "resources", "integrity", "internal")
#: Outcomes of a transfer's block checksums, as ``integrity_checks`` counts them.
INTEGRITY_RESULTS = ("ok", "mismatch", "not_checked")


def _registry_gauges(s: NodeSnapshot) -> Iterable[Metric]:
    """The fleet registry as this daemon sees it (:mod:`.fleet`)."""
    registry = GaugeMetricFamily(
        "kvxfer_registry_state", "1 for the fleet registry's state as this daemon sees it", labels=["state"]
    )
    for state in ("off", "connecting", "registered", "unreachable", "conflict"):
        registry.add_metric([state], s.registry.state == state)
    yield registry
    yield GaugeMetricFamily(
        "kvxfer_registry_nodes", "Daemons in the fleet registry, this one included", value=s.registry.nodes
    )


class Metrics:
    """The daemon's metrics in their own registry (several daemons may share a process in tests).

    A remote handoff is counted on both daemons, once with ``role="decode"`` (the puller) and
    once with ``role="prefill"`` (the offerer): sum one role for fleet-wide totals.
    """

    def __init__(self, snapshot: Callable[[], NodeSnapshot | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        #: Labelled series already made, by (metric, label values): see ``_child``.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        labels = ["role", "path", "transport", "result"]
        self.transfer_seconds = Histogram(
            "kvxfer_transfer_duration_seconds",
            "Time from a transfer's start to its end on this daemon",
            labels,
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.transfer_bytes = Counter(
            "kvxfer_transfer_bytes", "Payload bytes of ended transfers", labels, registry=self.registry
        )
        why = [*labels, "reason"]
        self.transfers = Counter(
            "kvxfer_transfers", "Ended transfers, and why failed ones failed", why, registry=self.registry
        )
        self.rpc_seconds = Histogram(
            "kvxfer_engine_rpc_duration_seconds",
            "Time the daemon took to answer an engine's call, by method and status code",
            ["method", "code"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.lease_expiries = Counter(
            "kvxfer_lease_expiries", "Offers released because nobody pulled them in time", registry=self.registry
        )
        self.offers_released = Counter(
            "kvxfer_offers_released", "Offers released, by reason", ["reason"], registry=self.registry
        )
        self.integrity_checks = Counter(
            "kvxfer_integrity_checks",
            "Block-checksum checks of transfers on this daemon (at the source before sending, where the "
            "blocks land), by mode and result (mismatch: the transfer failed with DATA_LOSS)",
            ["mode", "result"],
            registry=self.registry,
        )
        self.integrity_blocks = Counter(
            "kvxfer_integrity_blocks_checked", "Blocks whose checksums were compared", ["mode"], registry=self.registry
        )
        self.integrity_seconds = Counter(
            "kvxfer_integrity_seconds",
            "Time block checksums took, by step: digest (an offer written), source (re-checked once sent), "
            "landed (checked where the blocks landed)",
            ["step"],
            registry=self.registry,
        )
        self.tier_blocks = Counter(
            "kvxfer_tier_blocks",
            "Blocks copied into (store) or out of (load) the node's KV tier",
            ["op"],
            registry=self.registry,
        )
        self.tier_bytes = Counter(
            "kvxfer_tier_moved_bytes",
            "Bytes copied into (store) or out of (load) the KV tier",
            ["op"],
            registry=self.registry,
        )
        self.tier_seconds = Histogram(
            "kvxfer_tier_op_duration_seconds",
            "Time of KV tier stores and loads that copied blocks",
            ["op"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, resident memory, fds
        self.registry.register(_StateCollector(snapshot))

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once per label set (``labels()`` costs about
        3 us, and a handoff updates about a dozen series)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def transfer_finished(self, ended: EndedTransfer) -> None:
        """Record one ended transfer (its ``reason`` one of :data:`REASONS`)."""
        labels = (ended.role, ended.path, ended.transport or "none", ended.result)
        self._child(self.transfer_seconds, *labels).observe(ended.seconds)
        self._child(self.transfers, *labels, ended.reason).inc()
        if ended.result == "succeeded":
            self._child(self.transfer_bytes, *labels).inc(ended.nbytes)

    def integrity_checked(self, mode: str, result: str, blocks: int) -> None:
        """One checksum check (``result``: one of :data:`INTEGRITY_RESULTS`)."""
        self._child(self.integrity_checks, mode, result).inc()
        if blocks:
            self._child(self.integrity_blocks, mode).inc(blocks)

    def integrity_spent(self, step: str, seconds: float) -> None:
        """Time one integrity step took (``step``: digest, source or landed)."""
        self._child(self.integrity_seconds, step).inc(seconds)

    def tier_op_finished(self, op: str, blocks: int, nbytes: int, seconds: float) -> None:
        """A tier store or load that copied ``blocks`` blocks."""
        self._child(self.tier_blocks, op).inc(blocks)
        self._child(self.tier_bytes, op).inc(nbytes)
        self._child(self.tier_seconds, op).observe(seconds)

    def rpc_finished(self, method: str, code: str, seconds: float) -> None:
        self._child(self.rpc_seconds, method, code).observe(seconds)

    def offer_released(self, reason: str) -> None:
        self._child(self.offers_released, reason).inc()
        if reason == "expired":
            self.lease_expiries.inc()

    def render(self) -> bytes:
        """The text exposition format, as ``/metrics`` serves it."""
        return generate_latest(self.registry)


#: Scrapes served at once; more connections are closed at once (a scrape takes milliseconds).
MAX_SCRAPES = 16
#: Seconds a metrics connection may sit idle before it is closed.
SCRAPE_IDLE_S = 5.0


class _MetricsServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """HTTP server with a bounded number of connection threads, each with an idle timeout
    (prometheus_client's own server starts one unbounded thread per idle connection)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry) -> None:
        self.registry = registry
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        super().__init__(address, _MetricsHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    timeout = SCRAPE_IDLE_S
    server: _MetricsServer

    def do_GET(self) -> None:
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes are not events


def serve_metrics(metrics: Metrics, address: str) -> tuple[Any, str]:
    """Serve ``/metrics`` on ``host:port`` from a background thread; returns (server, bound address).
    At most :data:`MAX_SCRAPES` connections are served at once, each closed after
    :data:`SCRAPE_IDLE_S` idle."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise OSError(f"metrics_listen must be host:port, got {address!r}")
    bind = host.strip("[]")
    server_type = _MetricsServer6 if ":" in bind else _MetricsServer
    server = server_type((bind, int(port)), metrics.registry)
    threading.Thread(target=server.serve_forever, name="kvxfer-metrics", daemon=True).start()
    return server, f"{host}:{server.server_port}"
