"""Process lifecycle: load the settings, start (:mod:`._wiring` builds the daemon), serve, drain
on SIGTERM, exit 0."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

import uvloop

from kvxfer.tls import TlsFiles
from kvxfer.version import PROTOCOL_VERSION, __version__

from . import _wiring as wiring
from ._config import Settings, load_settings
from ._log import configure, log_event
from ._systemd import Notifier
from ._wiring import PEER_SERVICE, Running
from .control.listen_errors import ListenError
from .dataplane.ucx import UcxTransport
from .dataplane.ucx_setup import ucx_available
from .fleet import RegistryConflictError
from .memory.cuda_ipc import gpu_support, init_cuda

__all__ = ["main", "serve"]

#: Seconds past ``drain_grace_s`` that the rest of a shutdown may take before it is forced.
SHUTDOWN_EXTRA_S = 5.0


def _socket_in_use(path: str) -> bool:
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


async def serve(settings: Settings) -> int:
    """Run the daemon until SIGTERM/SIGINT (or an admin Drain); return the exit code."""
    ucx = _data_plane(settings)
    stop = asyncio.Event()
    running: Running | None = None

    def request_drain() -> None:
        if running is not None and not running.node.draining:
            log_event("daemon.drain", grace_s=settings.drain_grace_s)
            running.node.admission.drain()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_drain)
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)

    if _socket_in_use(settings.engine_socket):
        log_event("daemon.socket_in_use", logging.ERROR, path=settings.engine_socket)
        return 2
    try:
        tls = TlsFiles.from_paths(settings.tls_cert, settings.tls_key, settings.tls_ca)
    except ValueError as exc:
        log_event("daemon.tls_invalid", logging.ERROR, detail=str(exc))
        return 2
    try:
        running = await wiring.start(settings, ucx, tls, request_drain)
    except ListenError as exc:
        log_event(
            "daemon.listen_failed",
            logging.ERROR,
            listener=exc.listener,
            address=exc.address,
            reason=exc.reason,
            fix=exc.fix,
        )
        return 2
    if running.node.registry is not None:
        try:
            await running.node.registry.start()
        except RegistryConflictError as exc:
            log_event("daemon.registry_conflict", logging.ERROR, detail=str(exc))
            await _drain(settings, running, ucx)
            return 2
    if stop.is_set():  # asked to stop while starting
        request_drain()
    _announce_ready(settings, running, ucx, tls is not None)
    health_watch = asyncio.create_task(_watch_data_plane(running), name="data-plane-health")
    systemd = Notifier()
    systemd.notify(f"READY=1\nSTATUS=serving as {running.node.daemon_id}\nMAINPID={os.getpid()}")
    systemd.start_watchdog()

    await stop.wait()
    systemd.notify("STOPPING=1\nSTATUS=draining")
    # Whatever peers and UCX do from here (a frozen peer can block a channel or endpoint close
    # for as long as it stays frozen), the process is gone by this deadline.
    _exit_by(settings.drain_grace_s + SHUTDOWN_EXTRA_S)
    health_watch.cancel()
    finished = await _drain(settings, running, ucx)
    systemd.stop()
    log_event("daemon.exit", transfers_cancelled=not finished)
    if settings.ready_file and os.path.exists(settings.ready_file):
        os.unlink(settings.ready_file)
    return 0


def _data_plane(settings: Settings) -> UcxTransport | None:
    """The GPUs and UCX this daemon moves bytes with (None: local handoffs only)."""
    gpus = init_cuda()
    log_event("gpu.probe", gpus=",".join(gpus) or "none", detail=gpu_support() or "GPU pools supported")
    if not settings.ucx_enabled:
        log_event("ucx.disabled", logging.WARNING, detail="ucx_enabled is off: local pulls only")
        return None
    if not ucx_available():
        log_event("ucx.missing", logging.WARNING, detail="remote pulls disabled: install kvxfer[ucx]")
        return None
    return UcxTransport(iov_receive=settings.ucx_iov_receive, iov_send=settings.ucx_iov_send)


def _announce_ready(settings: Settings, running: Running, ucx: UcxTransport | None, tls: bool) -> None:
    """The ``daemon.ready`` log line, and the ready file where one is asked for."""
    node = running.node
    ready: dict[str, Any] = {
        "daemon_id": node.daemon_id,
        "pid": os.getpid(),
        "engine_socket": settings.engine_socket,
        "peer_address": node.peer_address,
        "admin_address": node.admin_address,
        "lanes_address": node.lanes_address,
        "metrics_address": running.metrics_address,
        "ucx_transports": ucx.transports if ucx else [],
        "tls": tls,
    }
    log_event("daemon.ready", **ready)
    if settings.ready_file:
        tmp = settings.ready_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(ready, fh)
        os.replace(tmp, settings.ready_file)


async def _drain(settings: Settings, running: Running, ucx: UcxTransport | None) -> bool:
    """Health says NOT_SERVING, no new offers or pulls, running transfers get the grace
    period, then whatever is left is cancelled and every offer released; then everything
    closes. True when every transfer finished by itself."""
    node = running.node
    for listener in running.listeners:
        await listener.set_serving(False)
    finished = await node.transfers.wait_idle(settings.drain_grace_s)
    if not finished:
        node.transfers.abort_all(f"daemon {node.daemon_id} is shutting down (drain grace over)")
        await node.transfers.wait_idle(2.0)
    if node.registry is not None:  # peers stop looking for us here once our work is done
        await node.registry.close(deregister=True)
    node.shutdown()
    running.fd_socket.close()
    for listener in running.listeners:
        await listener.server.stop(grace=1.0)
    if node.remote is not None:
        await node.remote.close()
    await node.peers.close()
    if ucx is not None:
        await ucx.close()
    if running.metrics_server is not None:
        running.metrics_server.shutdown()
    node.executor.shutdown(wait=True)
    return finished


def _exit_by(seconds: float) -> None:
    """Arm a timer thread that ends the process if shutdown has not finished in ``seconds``."""

    def force() -> None:
        log_event("daemon.exit_forced", logging.ERROR, after_s=seconds, detail="shutdown did not finish in time")
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()


def _dump_tasks() -> None:
    """SIGUSR1: write every asyncio task's stack to the log (what is a stuck daemon doing?)."""
    for task in asyncio.all_tasks():
        frames: list[str] = []
        awaited: Any = task.get_coro()
        while awaited is not None and len(frames) < 40:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
            if frame is not None:
                frames.append(f"{frame.f_code.co_name}@{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
        log_event("debug.task", name=task.get_name(), stack=" > ".join(frames))


async def _watch_data_plane(running: Running, interval_s: float = 1.0) -> None:
    """Health follows the data plane: without a working UCX the peer port is NOT_SERVING, and
    every listener says kvxfer.v1.PeerService is (so ``kvxferctl health`` over the Unix socket
    tells the same story as the log)."""
    node, reported = running.node, None
    while True:
        ok = node.data_plane_ok and not node.draining
        if ok != reported:
            await running.peer_listener.set_serving(ok)
            for listener in running.listeners:
                await listener.set_serving(ok, [PEER_SERVICE])
            if reported is not None or not ok:
                detail = "draining" if node.draining else node.data_plane_detail
                log_event("health.data_plane", logging.INFO if ok else logging.ERROR, serving=ok, detail=detail or "-")
            reported = ok
        await asyncio.sleep(interval_s)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``kvxferd``."""
    # A fatal signal (a native library touching unmapped memory) leaves a traceback in the log.
    faulthandler.enable()
    # SIGUSR2: every thread's Python stack, written at once even when the event loop is stuck
    # (SIGUSR1's task dump needs a running loop).
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    if "--version" in (sys.argv[1:] if argv is None else argv):
        print(f"kvxferd {__version__} (protocol {PROTOCOL_VERSION})")
        return
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv)
    except (ValueError, OSError) as exc:
        print(f"kvxferd: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    args = sys.argv[1:] if argv is None else list(argv)
    if "--print-config" in args:
        print(json.dumps(settings.as_dict(), indent=2))
        return
    configure(settings.log_level, settings.log_json)
    log_event("daemon.config", **settings.as_dict())
    profile_to = os.environ.get("KVXFERD_PROFILE")
    if not profile_to:
        # Not uvloop.run: after serve() returns it cancels every task left and waits for
        # them, and for the default executor's threads; a task or thread still inside UCXX
        # with a frozen peer never finishes, and the exit fell to the backstop timer (code 1).
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        code = loop.run_until_complete(serve(settings))
        # Leave without the interpreter's teardown either: UCXX closes endpoints there, and one
        # to a dead or frozen peer blocks for as long as the peer stays so. Everything the
        # daemon owes anyone (released offers, closed listeners, the log) is done by now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # Developers: cProfile the whole run, stats written to $KVXFERD_PROFILE.<pid> at exit.
    import cProfile

    profiler = cProfile.Profile()
    try:
        code = profiler.runcall(uvloop.run, serve(settings))
    finally:
        profiler.dump_stats(f"{profile_to}.{os.getpid()}")
    raise SystemExit(code)
