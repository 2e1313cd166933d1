"""Operating a daemon: Prometheus metrics and systemd notifications, from real processes."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cluster import Cluster, Daemon, _env
from kvxfer.version import PROTOCOL_VERSION


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample, matched by name and exact label set (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if got == labels:
            return float(m.group(3))
    return 0.0


SMALL = {"layers": 1, "blocks": 8, "block_bytes": 65536}


def settled(address: str, name: str, want: float, **labels: str) -> float:
    """A sample once it reads ``want`` (or its last value after 10 s): a pull's metrics follow
    its answer to the engine by a turn of its daemon's loop, which a loaded machine stretches."""
    deadline = time.monotonic() + 10
    while (got := sample(scrape(address), name, **labels)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def _handoff(prefill: Any, decode: Any) -> dict[str, Any]:
    """Pools of SMALL on both engines, blocks 0-1 offered and pulled into 3-4; the ticket."""
    prefill("pool", shape=SMALL, seed=2)
    decode("pool", shape=SMALL)
    ticket: dict[str, Any] = prefill("offer", requests=[[0, 1]])["tickets"][0]
    assert decode("pull", pulls=[[ticket, [3, 4]]])["results"][0]["ok"]
    return ticket


def test_metrics_count_transfers_bytes_offers_pools_and_expiries(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--default-lease-s", "0.5")
    prefill, decode = cluster.engine(a, "prefill"), cluster.engine(a, "decode")
    shape = {"layers": 2, "blocks": 32, "block_bytes": 4096}
    prefill("pool", shape=shape, seed=1)
    decode("pool", shape=shape)
    before = scrape(a.info["metrics_address"])
    assert sample(before, "kvxfer_pool_registered_bytes", memory_kind="host", device="cpu") == 2 * 2 * 2 * 32 * 4096
    assert sample(before, "kvxfer_build_info", version=_version(), protocol_version=str(PROTOCOL_VERSION)) == 1

    tickets = prefill("offer", requests=[[1, 2, 3], [4, 5]])["tickets"]
    assert sample(scrape(a.info["metrics_address"]), "kvxfer_offers_active") == 2
    assert decode("pull", pulls=[[tickets[0], [7, 8, 9]]])["results"][0]["ok"]
    time.sleep(1.5)  # the second offer's 0.5 s lease ends

    text = scrape(a.info["metrics_address"])
    ok = {"role": "decode", "path": "local", "transport": "local-copy", "result": "succeeded"}
    assert sample(text, "kvxfer_transfers_total", **ok, reason="none") == 1
    assert sample(text, "kvxfer_transfer_bytes_total", **ok) == 3 * 2 * 2 * 4096
    assert sample(text, "kvxfer_transfer_duration_seconds_count", **ok) == 1
    assert sample(text, "kvxfer_lease_expiries_total") == 1
    assert sample(text, "kvxfer_offers_released_total", reason="pulled") == 1
    assert sample(text, "kvxfer_offers_released_total", reason="expired") == 1
    assert sample(text, "kvxfer_offers_active") == 0
    assert sample(text, "kvxfer_transfers_active", role="decode") == 0
    assert sample(text, "kvxfer_serving") == 1
    assert sample(text, "kvxfer_ucx_receives_unconfirmed") == 0
    assert sample(text, "kvxfer_engine_rpc_duration_seconds_count", method="pull", code="OK") == 1
    assert sample(text, "kvxfer_engine_rpc_duration_seconds_count", method="offer", code="OK") == 2
    assert sample(text, "process_resident_memory_bytes") > 0
    # No request-scoped label values: no offer, transfer or session id appears anywhere.
    for ticket in tickets:
        assert ticket["offer_id"] not in text
    assert prefill.session_id not in text


def test_remote_transfers_are_labelled_with_their_ucx_transport(two_daemons: Cluster) -> None:
    a, b = two_daemons.daemons
    prefill, decode = two_daemons.engine(a, "p-metrics"), two_daemons.engine(b, "d-metrics")
    ticket = _handoff(prefill, decode)
    labels = {"path": "remote", "transport": "ucx:shm+cma", "result": "succeeded"}
    moved = 2 * 2 * 65536
    # Counted once per side, each under its role: a fleet sums one role.
    assert settled(b.info["metrics_address"], "kvxfer_transfer_bytes_total", moved, role="decode", **labels) == moved
    assert sample(scrape(a.info["metrics_address"]), "kvxfer_transfer_bytes_total", role="prefill", **labels) == moved
    assert sample(scrape(b.info["metrics_address"]), "kvxfer_peers", state="connected") == 1
    # A pull refused by the offerer (wrong token) moved nothing: refused, on no transport.
    forged = dict(ticket, token="00" * 16, offer_id=prefill("offer", requests=[[6, 7]])["tickets"][0]["offer_id"])
    assert decode("pull", pulls=[[forged, [6, 7]]])["results"][0]["type"] == "PermissionDeniedError"
    refused = {"path": "remote", "transport": "none", "result": "refused", "reason": "refused"}
    assert settled(b.info["metrics_address"], "kvxfer_transfers_total", 1, role="decode", **refused) == 1


def test_fragmented_host_transfers_move_without_staging_and_staged_ones_show_it(cluster: Cluster) -> None:
    """By default UCX gathers and scatters a host pool's segments itself: neither daemon
    allocates staging. With IOV off, the staging each side made is reported."""
    shape = {"layers": 2, "blocks": 16, "block_bytes": 48 * 1024}

    def staging_after_one_pull(tag: str, *send_args: str) -> tuple[float, float]:
        a = cluster.daemon(f"a-{tag}", *send_args)
        b = cluster.daemon(f"b-{tag}", *(("--no-ucx-iov-receive",) if send_args else ()))
        prefill, decode = cluster.engine(a, f"p-{tag}"), cluster.engine(b, f"d-{tag}")
        prefill("pool", shape=shape, seed=4)
        decode("pool", shape=shape)
        ticket = prefill("offer", requests=[[9, 2, 5, 0]])["tickets"][0]
        assert decode("pull", pulls=[[ticket, [1, 7, 3, 12]]])["results"][0]["ok"]
        assert decode("verify", seed=4, pairs=[[[9, 2, 5, 0], [1, 7, 3, 12]]])["verified"]
        sent = sample(scrape(a.info["metrics_address"]), "kvxfer_staging_bytes_allocated", direction="send")
        received = sample(scrape(b.info["metrics_address"]), "kvxfer_staging_bytes_allocated", direction="receive")
        return sent, received

    assert staging_after_one_pull("iov") == (0, 0)
    sent, received = staging_after_one_pull("staged", "--no-ucx-iov-send")
    assert sent > 0 and received > 0


def test_the_daemon_tells_systemd_ready_pings_the_watchdog_and_says_stopping(cluster: Cluster) -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="kvxfer-notify-"), "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    try:
        d = cluster.daemon("a", env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
        messages = [sock.recv(4096).decode() for _ in range(4)]  # READY, then pings every 0.1 s
        assert messages[0].startswith("READY=1\n") and "MAINPID=" in messages[0]
        assert messages[1:] == ["WATCHDOG=1"] * 3
        assert d.terminate() == 0
        rest = []
        while True:
            try:
                rest.append(sock.recv(4096).decode())
            except TimeoutError:
                break
            if rest[-1].startswith("STOPPING=1"):
                break
        assert rest and rest[-1].startswith("STOPPING=1")
    finally:
        sock.close()
        os.unlink(path)


def _version() -> str:
    from kvxfer_client import __version__

    return __version__


def test_kvxferctl_health_and_a_watched_transfer_list(cluster: Cluster) -> None:
    a = cluster.daemon("a")

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "kvxfer_client._ctl", "--socket", a.socket, *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)

    assert (ctl("health").returncode, ctl("health").stdout.strip()) == (0, "serving")
    assert json.loads(ctl("--json", "health").stdout) == {
        "status": "SERVING",
        "parts": {"daemon": "SERVING", "data_plane": "SERVING"},
        "problems": [],
    }
    watched = ctl("--json", "transfers", "--watch", "--interval", "0.05", "--count", "3")
    frames = [json.loads(line) for line in watched.stdout.splitlines()]
    assert watched.returncode == 0 and len(frames) == 3 and all(f["transfers"] == [] for f in frames)
    human = ctl("transfers", "--watch", "--interval", "0.05", "--count", "2").stdout
    assert human.count("transfers (0)") == 2
    assert ctl("drain").returncode == 0
    assert a.proc is not None and a.proc.wait(30) == 0
    assert ctl("health").returncode == 3  # gone after draining: unreachable


def ended_records(daemon: Daemon, transfer_id: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The daemon's JSON log records once one of them says ``transfer_id`` ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
        if any(r.get("transfer_id") == transfer_id and r["event"].startswith("transfer.") for r in records):
            return records
        assert time.monotonic() < deadline, f"{daemon.name} logged no end of {transfer_id}:\n{daemon.log()}"
        time.sleep(0.02)


def test_json_logs_one_line_per_lifecycle_event_with_ids_and_nothing_per_segment(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--log-json")
    b = cluster.daemon("b", "--log-json")
    prefill, decode = cluster.engine(a, "log-prefill"), cluster.engine(b, "log-decode")
    shape = {"layers": 4, "blocks": 256, "block_bytes": 4096}
    prefill("pool", shape=shape, seed=5)
    decode("pool", shape=shape)
    ticket = prefill("offer", requests=[list(range(0, 256, 2))])["tickets"][0]  # 128 blocks: 1024 segments
    result = decode("pull", pulls=[[ticket, list(range(128))]])["results"][0]
    assert result["ok"]
    prefill("released", offer_ids=[ticket["offer_id"]])
    for daemon in (a, b):
        # The pull's own line follows its answer (its release completes off the engine's path):
        # wait for it, bounded, instead of reading the log the moment the engine has its answer.
        records = ended_records(daemon, result["transfer_id"])
        assert records and all({"ts", "level", "event"} <= r.keys() for r in records)
        for r in records:
            if r["event"].startswith("transfer."):
                assert r["transfer_id"] == result["transfer_id"] and r["offer_id"] == ticket["offer_id"]
            if r["event"].startswith("offer."):
                assert r["offer_id"] == ticket["offer_id"]
        about_it = [r for r in records if result["transfer_id"] in json.dumps(r) or ticket["offer_id"] in json.dumps(r)]
        assert 1 <= len(about_it) <= 6, [r["event"] for r in about_it]  # not one per segment or chunk


def test_without_a_data_plane_the_peer_port_is_not_serving_but_local_handoffs_work(cluster: Cluster) -> None:
    a = cluster.daemon("a", "--no-ucx-enabled")
    b = cluster.daemon("b")

    def health(target: str) -> int:
        with grpc.insecure_channel(target) as channel:
            return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status)

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    deadline = time.monotonic() + 5
    while health(a.info["peer_address"]) != not_serving and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health(a.info["peer_address"]) == not_serving
    assert health("unix:" + a.socket) == serving
    assert health(b.info["peer_address"]) == serving
    # Log, Status and kvxferctl tell one story, naming the part that does not serve.
    assert "health.data_plane" in a.log() and "ucx_enabled is off" in a.log()
    cmd = [sys.executable, "-m", "kvxfer_client._ctl", "--socket", a.socket, "health"]
    told = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
    assert told.returncode == 1 and told.stdout.startswith("degraded"), told.stdout
    assert "data plane (remote handoffs): ucx_enabled is off" in told.stdout
    with grpc.insecure_channel("unix:" + a.socket) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        assert check(health_pb2.HealthCheckRequest(service="kvxfer.v1.PeerService"), timeout=5).status == not_serving

    shape = {"layers": 1, "blocks": 8, "block_bytes": 4096}
    prefill, local, remote = cluster.engine(a, "p"), cluster.engine(a, "dl"), cluster.engine(b, "dr")
    prefill("pool", shape=shape, seed=3)
    local("pool", shape=shape)
    remote("pool", shape=shape)
    t1, t2 = prefill("offer", requests=[[1], [2]])["tickets"]
    assert local("pull", pulls=[[t1, [5]]])["results"][0]["ok"]
    failed = remote("pull", pulls=[[t2, [5]]])["results"][0]
    # The Hello already tells: the peer has no UCX worker (FAILED_PRECONDITION, named).
    assert not failed["ok"] and failed["type"] == "IncompatibleError" and "UCX" in failed["error"]


def test_the_daemon_logs_the_ucx_settings_it_chose_and_each_endpoints_transport(cluster: Cluster) -> None:
    a = cluster.daemon("a", env={"UCX_RNDV_THRESH": "131072", "UCX_TLS": "self,sm,tcp"})
    b = cluster.daemon("b")
    settings = next(line for line in a.log().splitlines() if "ucx.settings" in line)
    assert "UCXPY_PROGRESS_MODE=blocking" in settings.split("environment_overrode=")[0]  # set by the daemon
    assert "environment_overrode=UCX_RNDV_THRESH=131072" in settings
    assert "UCX_TLS=self,sm,tcp" in settings
    prefill, decode = cluster.engine(a, "p"), cluster.engine(b, "d")
    _handoff(prefill, decode)
    for daemon, peer in ((a, "b"), (b, "a")):
        endpoint = [line for line in daemon.log().splitlines() if "ucx.endpoint " in line]
        assert len(endpoint) == 1 and f"peer={peer}" in endpoint[0] and "transport=ucx:" in endpoint[0], endpoint


def test_kvxferctl_json_carries_raw_numbers_and_everything_the_table_shows(two_daemons: Cluster) -> None:
    a, b = two_daemons.daemons
    prefill, decode = two_daemons.engine(a, "p-json"), two_daemons.engine(b, "d-json")
    ticket = _handoff(prefill, decode)
    prefill("offer", requests=[[5]], lease_s=600)

    def ctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "kvxfer_client._ctl", "--socket", daemon.socket, *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)

    # The flag works before and after the subcommand, with the same answer (offers of other
    # tests on these shared daemons may expire in between: only long-leased ones compared).
    def lasting(listed: str) -> list[str]:
        return [o["offer"] for o in json.loads(listed) if o["lease_left_s"] > 60]

    offers = json.loads(ctl(a, "offers", "--json").stdout)
    assert lasting(ctl(a, "offers", "--json").stdout) == lasting(ctl(a, "--json", "offers").stdout)
    (offer,) = [o for o in offers if o["blocks"] == 1 and o["lease_left_s"] > 60]
    assert offer["bytes"] == 2 * 65536 and isinstance(offer["lease_left_s"], float)
    (done,) = [t for t in json.loads(ctl(b, "transfers", "--all", "--json").stdout) if t["offer"] == ticket["offer_id"]]
    assert done["bytes"] == 4 * 65536 and isinstance(done["duration_s"], float) and done["gb_per_s"] > 0
    assert done["state"] == "succeeded" and done["transport"].startswith("ucx:")
    # The default integrity mode sums a few random segments of each offer (of 1 to 4 blocks here).
    assert (done["integrity_mode"], done["integrity_result"]) == ("sampled", "ok")
    assert 1 <= done["integrity_blocks"] <= 4
    assert done["integrity"] == f"sampled {done['integrity_blocks']} ok"
    status = json.loads(ctl(b, "status", "--json").stdout)
    s = status["status"]
    assert s["state"] == "serving" and s["bytes_moved"] >= 4 * 65536 and s["transfers_succeeded"] >= 1
    assert isinstance(s["ucx_transports"], list) and "ucx_endpoints" in s and "lease_expiries" in s
    (pool,) = [p for p in status["pools"] if p["engine"] == "d-json"]
    assert pool["bytes"] == 2 * 8 * 65536 and len(pool["fingerprint"]) > 12
    assert [p["peer"] for p in status["peers"]] == ["a"] and isinstance(status["peers"][0]["transports"], list)
    # The table still shows sizes for people.
    assert "KiB" in ctl(b, "transfers", "--all").stdout


def test_kvxferctl_into_a_closed_pipe_prints_no_traceback(cluster: Cluster) -> None:
    a = cluster.daemon("a")
    # `true` has closed the pipe long before kvxferctl (a Python start-up later) writes to it,
    # as `head -1` does once it has its line.
    cmd = f"{shlex.quote(sys.executable)} -m kvxfer_client._ctl --socket {shlex.quote(a.socket)} status | true"
    done = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=_env(), check=False)
    assert done.stderr == "", done.stderr


def test_a_live_daemons_metrics_pass_promtool(two_daemons: Cluster) -> None:
    # make test installs promtool (Debian's prometheus package): this check must not skip.
    text = scrape(two_daemons.daemons[1].info["metrics_address"])
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr
