"""The deployment files say what the daemon needs (their schemas are checked by `make lint`)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

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
