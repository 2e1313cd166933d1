"""The shipped deployments as they run: a non-root daemon in a directory the kubelet made, and
the systemd unit's model of a daemon user and engines of another user in its group.

The other users need the interpreter, which may sit under a root-only home: they run with
CAP_DAC_READ_SEARCH as their only capability (read and search anything, write only where their
own permissions allow), which keeps every write and every shared-memory open their own."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
import yaml

from bench.cluster import ROOT, Cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs the daemon and engines as other users: needs root")

DAEMON_UID = 10001  # the DaemonSet's runAsUser and the systemd unit's kvxfer user
ENGINE_UID = 10002


def as_user(uid: int, gid: int, groups: list[int] | None = None) -> list[str]:
    extra = ",".join(map(str, groups)) if groups else ""
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        f"--groups={extra}" if extra else "--clear-groups",
        "--inh-caps=+dac_read_search",
        "--ambient-caps=+dac_read_search",
    ]


def _hostpath(cluster: Cluster) -> str:
    """A directory as the kubelet makes a hostPath: root:root 0755."""
    os.chmod(cluster.workdir, 0o755)
    run = os.path.join(cluster.workdir, "run-kvxfer")
    os.mkdir(run)
    os.chmod(run, 0o755)
    return run


def test_a_non_root_daemon_in_a_root_owned_directory_says_which_listener_where_why(cluster: Cluster) -> None:
    run = _hostpath(cluster)
    with pytest.raises(RuntimeError, match="exited with 2") as failure:
        cluster.daemon("a", "--engine-socket", f"{run}/kvxferd.sock", prefix=as_user(DAEMON_UID, DAEMON_UID))
    log = failure.value.args[0]
    lines = [line for line in log.splitlines() if "daemon.listen_failed" in line]
    assert len(lines) == 1, log
    assert 'listener="engine socket"' in lines[0] and "permission denied" in lines[0] and run in lines[0], lines[0]
    assert "Traceback" not in log


def test_the_daemonsets_init_step_makes_that_directory_work(cluster: Cluster) -> None:
    run = _hostpath(cluster)
    os.chmod(cluster.workdir, 0o1777)  # the test harness's ready file goes there
    with open(os.path.join(ROOT, "deploy/kubernetes/daemonset.yaml")) as fh:
        (init,) = yaml.safe_load(fh)["spec"]["template"]["spec"]["initContainers"]
    script = init["command"][-1].replace("/run/kvxfer", shlex.quote(run))
    subprocess.run(["sh", "-c", script], check=True)  # as the init container: root
    d = cluster.daemon("a", "--engine-socket", f"{run}/kvxferd.sock", prefix=as_user(DAEMON_UID, DAEMON_UID))
    assert os.stat(f"{run}/kvxferd.sock").st_uid == DAEMON_UID
    assert d.proc is not None and d.proc.poll() is None


def test_a_port_in_use_is_named_with_its_listener(cluster: Cluster) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="exited with 2") as failure:
            cluster.daemon("a", "--peer-listen", f"127.0.0.1:{port}")
    line = next(line for line in failure.value.args[0].splitlines() if "daemon.listen_failed" in line)
    assert "listener=peer " in line and "address in use" in line and str(port) in line, line


def test_the_systemd_units_model_a_daemon_user_and_engines_of_another_user_hand_off(cluster: Cluster) -> None:
    # The unit: User=kvxfer, RuntimeDirectory=kvxfer (0750, the daemon's), the shipped config
    # with engine_socket_group=kvxfer. Engines: another user in group kvxfer, umask 077, so
    # their shared memory is theirs alone (0600): the daemon maps it from the passed fds.
    os.chmod(cluster.workdir, 0o1777)  # the test harness's ready file goes there
    run = os.path.join(cluster.workdir, "run-kvxfer")
    os.mkdir(run)
    os.chown(run, DAEMON_UID, DAEMON_UID)
    os.chmod(run, 0o750)
    config = os.path.join(ROOT, "deploy/systemd/kvxferd.yaml")
    for name in ("a", "b"):  # where the harness's engines look for each daemon's sockets
        for suffix in ("", ".fds"):
            os.symlink(f"{run}/{name}.sock{suffix}", os.path.join(cluster.workdir, f"{name}.sock{suffix}"))
    daemons = [
        cluster.daemon(
            name,
            *("--config", config, "--engine-socket", f"{run}/{name}.sock", "--engine-socket-group", str(DAEMON_UID)),
            *("--peer-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"),
            *("--tcp-lanes-listen", "127.0.0.1:0"),
            prefix=as_user(DAEMON_UID, DAEMON_UID),
        )
        for name in ("a", "b")
    ]
    engine_user = as_user(ENGINE_UID, ENGINE_UID, groups=[DAEMON_UID])
    shape = {"layers": 2, "blocks": 8, "block_bytes": 4096}
    prefill = cluster.engine(daemons[0], "p", prefix=engine_user, popen={"umask": 0o077})
    prefill("pool", shape=shape, seed=5)
    for daemon in daemons:  # local, then remote
        decode = cluster.engine(daemon, f"d-{daemon.name}", prefix=engine_user, popen={"umask": 0o077})
        decode("pool", shape=shape)
        ticket = prefill("offer", requests=[[1, 2, 3]], lease_s=60)["tickets"][0]
        result = decode("pull", pulls=[[ticket, [7, 0, 4]]])["results"][0]
        assert result["ok"], result
        assert decode("verify", seed=5, pairs=[[[1, 2, 3], [7, 0, 4]]])["verified"]
    assert os.stat(f"{run}/a.sock").st_gid == DAEMON_UID


def test_engine_memory_of_another_user_is_refused_naming_the_fix_and_of_the_same_user_hands_off(
    cluster: Cluster,
) -> None:
    """Process memory (numpy arrays, torch tensors) is reached through the kernel, which lets a
    daemon read only its own user's processes (without CAP_SYS_PTRACE)."""
    os.chmod(cluster.workdir, 0o1777)
    daemon = cluster.daemon(
        "a",
        "--engine-socket-group",
        str(DAEMON_UID),
        prefix=as_user(DAEMON_UID, DAEMON_UID),
    )
    shape = {"layers": 2, "blocks": 8, "block_bytes": 4096}
    stranger = cluster.engine(daemon, "other-user", prefix=as_user(ENGINE_UID, ENGINE_UID, groups=[DAEMON_UID]))
    refused = stranger.call("pool", shape=shape, memory="numpy")
    assert refused["type"] == "PermissionDeniedError", refused
    assert f"kvxferd runs as uid {DAEMON_UID}, the engine as uid {ENGINE_UID}" in refused["error"]
    assert "HostBuffer.create" in refused["error"]
    assert stranger("pool", shape=shape, memory="host")["pool_id"]  # the fix it names works

    same_user = as_user(DAEMON_UID, DAEMON_UID)
    prefill = cluster.engine(daemon, "p", prefix=same_user)
    decode = cluster.engine(daemon, "d", prefix=same_user)
    prefill("pool", shape=shape, seed=6, memory="torch")
    decode("pool", shape=shape, memory="numpy")
    ticket = prefill("offer", requests=[[1, 2, 3]])["tickets"][0]
    assert decode("pull", pulls=[[ticket, [5, 6, 7]]])["results"][0]["ok"]
    assert decode("verify", seed=6, pairs=[[[1, 2, 3], [5, 6, 7]]])["verified"]
