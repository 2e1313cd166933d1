"""The deployment files say what the daemon needs (their schemas are checked by `make lint`)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from kvxferd._config import load_settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def unit_file(path: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    with open(path) as fh:
        for raw in fh:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            sections[section][key].append(value)
    return sections


def test_the_systemd_unit_is_notify_with_watchdog_unlimited_memlock_and_restarts() -> None:
    unit = unit_file(os.path.join(ROOT, "deploy/systemd/kvxferd.service"))["Service"]
    assert unit["Type"] == ["notify"]
    assert int(unit["WatchdogSec"][0]) > 0
    assert unit["LimitMEMLOCK"] == ["infinity"]
    assert unit["Restart"] == ["on-failure"]
    assert unit["KillSignal"] == ["SIGTERM"]
    # Stopping waits longer than the drain grace the config gives running transfers.
    config = load_settings(["--config", os.path.join(ROOT, "deploy/systemd/kvxferd.yaml")], environ={})
    assert int(unit["TimeoutStopSec"][0]) > config.drain_grace_s
    assert config.engine_socket == "/run/kvxfer/kvxferd.sock"
    assert unit["RuntimeDirectory"] == ["kvxfer"]


def test_the_kubernetes_config_map_holds_settings_the_daemon_accepts(tmp_path: Path) -> None:
    with open(os.path.join(ROOT, "deploy/kubernetes/configmap.yaml")) as fh:
        cm = yaml.safe_load(fh)
    path = str(tmp_path / "kvxferd.yaml")
    with open(path, "w") as fh:
        fh.write(cm["data"]["kvxferd.yaml"])
    settings = load_settings(["--config", path], environ={})
    assert settings.metrics_listen == "0.0.0.0:7463"


def test_the_daemonset_probes_grpc_health_and_scrapes_metrics_on_the_configured_ports() -> None:
    with open(os.path.join(ROOT, "deploy/kubernetes/daemonset.yaml")) as fh:
        ds = yaml.safe_load(fh)
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    container = spec["containers"][0]
    assert spec["hostIPC"] and spec["hostPID"]
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    assert any(k.startswith("rdma/") for k in container["resources"]["limits"])
    assert container["readinessProbe"]["grpc"]["port"] == 7462 == container["livenessProbe"]["grpc"]["port"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "7463"


def test_the_daemonset_hands_the_socket_directory_to_the_daemons_user_before_it_starts() -> None:
    with open(os.path.join(ROOT, "deploy/kubernetes/daemonset.yaml")) as fh:
        spec = yaml.safe_load(fh)["spec"]["template"]["spec"]
    daemon = spec["containers"][0]["securityContext"]
    (init,) = spec["initContainers"]
    command = " ".join(init["command"])
    assert f"chown {daemon['runAsUser']}:{daemon['runAsGroup']} /run/kvxfer" in command
    assert init["volumeMounts"][0]["mountPath"] == "/run/kvxfer"


def _exported_names() -> set[str]:
    """Every sample name the daemon's metrics can carry (from the HELP lines of each family)."""
    import re

    from kvxferd._metrics import Metrics

    names = set(re.findall(r"^# HELP (\w+)", Metrics().render().decode(), re.MULTILINE))
    return names | {n + suffix for n in names for suffix in ("_bucket", "_count", "_sum", "_total", "_created")}


def _queries() -> list[str]:
    import json

    with open(os.path.join(ROOT, "deploy/prometheus/kvxfer-alerts.yaml")) as fh:
        rules = yaml.safe_load(fh)
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    with open(os.path.join(ROOT, "deploy/grafana/kvxfer-dashboard.json")) as fh:
        board = json.load(fh)
    exprs += [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_the_dashboard_and_alerts_read_only_metrics_the_daemon_exports() -> None:
    import re

    exported = _exported_names()
    used = {m for expr in _queries() for m in re.findall(r"\b((?:kvxfer|process)_\w+)", expr)}
    assert used, "no metric found in the dashboard or the rules"
    assert used <= exported, f"not exported by kvxferd: {sorted(used - exported)}"
    # What an SRE expects on the board: throughput, latency, failures, leases, staging, peers.
    assert {"kvxfer_transfer_bytes_total", "kvxfer_transfer_duration_seconds_bucket", "kvxfer_transfers_total"} <= used
    assert {"kvxfer_lease_expiries_total", "kvxfer_staging_bytes_in_use", "kvxfer_peers"} <= used


def test_the_committed_dashboard_is_what_its_generator_writes(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "board.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools/make_dashboard.py"), str(out)], check=True)
    with open(os.path.join(ROOT, "deploy/grafana/kvxfer-dashboard.json")) as fh:
        assert fh.read() == out.read_text(), "run: python tools/make_dashboard.py"


def test_constraints_pin_every_dependency_make_test_and_the_image_install() -> None:
    import re
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    wanted = list(project["dependencies"])
    for extra in ("ucx", "test", "e2e", "docs", "cu12"):
        wanted += project["optional-dependencies"][extra]
    names = {re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower().replace("_", "-") for req in wanted}
    with open(os.path.join(ROOT, "constraints.txt")) as fh:
        pinned = {
            line.split("==")[0].lower().replace("_", "-") for line in fh if "==" in line and not line.startswith("#")
        }
    assert names <= pinned, f"not pinned in constraints.txt: {sorted(names - pinned)}"
    with open(os.path.join(ROOT, "Makefile")) as fh:
        assert "-c constraints.txt" in fh.read()
    with open(os.path.join(ROOT, "Dockerfile")) as fh:
        dockerfile = fh.read()
    assert "-c constraints.txt" in dockerfile and "sha256sum --check" in dockerfile


def test_the_daemonset_advertises_the_pods_address_and_takes_the_registry_from_its_config_map(tmp_path: Path) -> None:
    with open(os.path.join(ROOT, "deploy/kubernetes/daemonset.yaml")) as fh:
        env = {e["name"]: e for e in yaml.safe_load(fh)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["KVXFERD_PEER_ADVERTISE"]["value"] == "$(POD_IP):7461"
    with open(os.path.join(ROOT, "deploy/kubernetes/fleet-configmap.yaml")) as fh:
        fleet = yaml.safe_load(fh)
    for name, key in (("KVXFERD_REGISTRY", "registry"), ("KVXFERD_CLUSTER", "cluster")):
        ref = env[name]["valueFrom"]["configMapKeyRef"]
        assert (ref["name"], ref["key"], ref["optional"]) == (fleet["metadata"]["name"], key, True)
    with open(os.path.join(ROOT, "deploy/kubernetes/configmap.yaml")) as fh:
        path = tmp_path / "kvxferd.yaml"
        path.write_text(yaml.safe_load(fh)["data"]["kvxferd.yaml"])
    # What the pod runs with: the file, the fleet ConfigMap and the pod's IP in the environment.
    environ = {
        "KVXFERD_REGISTRY": fleet["data"]["registry"],
        "KVXFERD_CLUSTER": fleet["data"]["cluster"],
        "KVXFERD_PEER_ADVERTISE": "10.1.2.3:7461",
    }
    settings = load_settings(["--config", str(path)], environ=environ)
    assert settings.registry.startswith("etcd://") and settings.peer_advertise == "10.1.2.3:7461"
    with pytest.raises(ValueError, match="not routable"):  # what the pod would do without its IP
        load_settings(["--config", str(path)], environ={**environ, "KVXFERD_PEER_ADVERTISE": ""})
