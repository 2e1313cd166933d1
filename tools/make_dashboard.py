"""Write the Grafana dashboard for kvxferd (deploy/grafana/kvxfer-dashboard.json).

Usage: python tools/make_dashboard.py [OUTPUT]

The panels are listed here, one line each, so a change is a one-line diff; the JSON is
generated from them. ``tests/unit/test_deploy.py`` checks that the committed file is current
and that every metric a panel reads is one the daemon exports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "deploy" / "grafana" / "kvxfer-dashboard.json"
DECODE = 'role="decode", instance=~"$instance"'

#: (title, unit, [(legend, PromQL)], width): one panel each, laid out in rows of 24 columns.
PANELS: list[tuple[str, str, list[tuple[str, str]], int]] = [
    (
        "Throughput by transport (pulled here)",
        "Bps",
        [("{{transport}}", f"sum by (transport) (rate(kvxfer_transfer_bytes_total{{{DECODE}}}[$__rate_interval]))")],
        12,
    ),
    (
        "Handoff time p50 / p99 (succeeded pulls)",
        "s",
        [
            (
                f"p{q} {{{{path}}}}",
                f"histogram_quantile(0.{q}, sum by (le, path) "
                f'(rate(kvxfer_transfer_duration_seconds_bucket{{{DECODE}, result="succeeded"}}[$__rate_interval])))',
            )
            for q in ("50", "99")
        ],
        12,
    ),
    (
        "Failures by reason",
        "ops",
        [
            (
                "{{role}} {{result}}: {{reason}}",
                'sum by (role, result, reason) (rate(kvxfer_transfers_total{result!="succeeded", '
                'instance=~"$instance"}[$__rate_interval]))',
            )
        ],
        12,
    ),
    (
        "Engine call latency p99",
        "s",
        [
            (
                "{{method}}",
                "histogram_quantile(0.99, sum by (le, method) "
                '(rate(kvxfer_engine_rpc_duration_seconds_bucket{instance=~"$instance"}[$__rate_interval])))',
            )
        ],
        12,
    ),
    (
        "Offers and leases",
        "short",
        [
            ("offers active", 'sum(kvxfer_offers_active{instance=~"$instance"})'),
            ("lease expiries /s", 'sum(rate(kvxfer_lease_expiries_total{instance=~"$instance"}[$__rate_interval]))'),
            (
                "released /s: {{reason}}",
                'sum by (reason) (rate(kvxfer_offers_released_total{instance=~"$instance"}[$__rate_interval]))',
            ),
        ],
        12,
    ),
    (
        "Staging in use / limit",
        "percentunit",
        [
            (
                "{{instance}} {{direction}}",
                'kvxfer_staging_bytes_in_use{instance=~"$instance"}'
                ' / kvxfer_staging_bytes_limit{instance=~"$instance"}',
            )
        ],
        12,
    ),
    (
        "Peers",
        "short",
        [("{{state}}", 'sum by (state) (kvxfer_peers{instance=~"$instance"})')],
        8,
    ),
    (
        "Transfers running",
        "short",
        [("{{role}}", 'sum by (role) (kvxfer_transfers_active{instance=~"$instance"})')],
        8,
    ),
    (
        "Daemons serving",
        "short",
        [("serving", 'sum(kvxfer_serving{instance=~"$instance"})'), ("up", 'sum(up{job="kvxferd"})')],
        8,
    ),
    # The fleet (docs/fleet.md): what the registry lists against what Prometheus reaches.
    (
        "Fleet: daemons registered and up",
        "short",
        [
            ("listed by the registry", "max(kvxfer_registry_nodes)"),
            ("registered by their own word", 'sum(kvxfer_registry_state{state="registered"})'),
            ("up (scraped)", 'sum(up{job="kvxferd"})'),
        ],
        12,
    ),
    (
        "Fleet: registry state per daemon",
        "short",
        [("{{state}}", 'sum by (state) (kvxfer_registry_state{instance=~"$instance"})')],
        12,
    ),
]


def dashboard() -> dict[str, object]:
    panels, x, y = [], 0, 0
    for i, (title, unit, queries, width) in enumerate(PANELS):
        if x + width > 24:
            x, y = 0, y + 8
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": width, "x": x, "y": y},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(65 + j), "expr": expr, "legendFormat": legend}
                    for j, (legend, expr) in enumerate(queries)
                ],
            }
        )
        x += width
    return {
        "title": "kvxfer",
        "uid": "kvxfer",
        "tags": ["kvxfer", "llm-serving"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
                {
                    "name": "instance",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(kvxfer_build_info, instance)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")


if __name__ == "__main__":
    main()
