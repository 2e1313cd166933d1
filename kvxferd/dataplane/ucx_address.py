"""Checks a peer's UCX worker address before this daemon's UCX unpacks it.

UCX trusts the worker addresses it is given: ``ucp_ep_create`` walks the packed bytes without
a length and asserts on what it does not expect (random bytes abort the process with
``Assertion `*addr_version == UCP_OBJECT_VERSION_V2' failed``). A worker address comes from a
peer's Hello, so it is hostile until checked, in two steps:

1. :func:`check_worker_address` — structure: a size UCX produces (16 B..16 KiB, ours is about
   200 B), a known address version (the low 4 bits of the first byte: V1 or V2), not all zeros.
   It refuses random bytes 7 times in 8 at no cost, and every Hello goes through it.
2. :class:`AddressProbe` — the unpack itself, in a child process with its own UCX worker: the
   child makes an endpoint from the address and closes it. If UCX aborts, the child dies, not
   the daemon, and the address is refused. Each address is probed once (verdicts are kept), so
   only the first endpoint to a peer pays for it (a few milliseconds once the child is up).

Either refusal is :class:`~kvxfer_client.IncompatibleError` naming the peer: the peer is
failed, the daemon keeps serving.

>>> check_worker_address(b"\\x20" + bytes(range(1, 200)), "peer-1")
>>> check_worker_address(b"\\x2b" + bytes(199), "peer-1")
Traceback (most recent call last):
...
kvxfer_client.IncompatibleError: peer peer-1 sent a malformed UCX worker address: unknown address version 11
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import struct
import sys
from collections import OrderedDict

from kvxfer.errors import IncompatibleError

from .._log import log_event
from .spawn import SpawnedChild, spawn_child

__all__ = ["MAX_ADDRESS_BYTES", "AddressProbe", "check_worker_address"]

MIN_ADDRESS_BYTES = 16
MAX_ADDRESS_BYTES = 16 << 10
#: UCP address versions (low nibble of the header byte): V1 = 0, V2 = 1.
_KNOWN_VERSIONS = (0, 1)
#: Seconds one probe may take before the child is killed and the address refused.
PROBE_TIMEOUT_S = 10.0
#: Seconds the child may take to start (it imports UCX: about a second here).
PROBE_START_S = 30.0
_VERDICTS_KEPT = 4096
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ucx_probe_child.py")


def check_worker_address(address: bytes, peer: str) -> None:
    """Refuse (IncompatibleError) a worker address whose structure UCX would not produce."""

    def refuse(why: str) -> IncompatibleError:
        return IncompatibleError(f"peer {peer[:100]} sent a malformed UCX worker address: {why}")

    if not MIN_ADDRESS_BYTES <= len(address) <= MAX_ADDRESS_BYTES:
        raise refuse(f"{len(address)} bytes, expected {MIN_ADDRESS_BYTES}..{MAX_ADDRESS_BYTES}")
    version = address[0] & 0x0F
    if version not in _KNOWN_VERSIONS:
        raise refuse(f"unknown address version {version}")
    if not any(address):
        raise refuse("all zero bytes")


class AddressProbe:
    """A child process that unpacks worker addresses with its own UCX, one at a time.

    :meth:`start` spawns it in the background (importing UCX takes about a second here); the
    first :meth:`check` waits for it. A probe runs to its end even when its caller is
    cancelled, so the child's answers never fall out of step with its questions.
    """

    def __init__(self) -> None:
        self._proc: SpawnedChild | None = None
        self._starting: asyncio.Task[SpawnedChild] | None = None
        self._lock = asyncio.Lock()
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # digest -> "" (fine) or why not
        self.crashes = 0

    def start(self) -> None:
        """Spawn the child now (unless it is already starting or up), so a peer's first
        endpoint does not wait for it."""
        if self._proc is not None and self._proc.returncode is None:
            return
        if self._starting is None or self._starting.done():
            self._starting = asyncio.get_running_loop().create_task(self._spawn(), name="ucx-address-probe")

    async def check(self, address: bytes, error_handling: bool, peer: str) -> None:
        """Raise IncompatibleError unless UCX can make an endpoint from ``address`` and survive."""
        key = hashlib.blake2b(address + bytes([error_handling]), digest_size=16).digest()
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = await asyncio.shield(self._verdict(key, address, error_handling))
        if verdict:
            raise IncompatibleError(f"peer {peer[:100]} sent a malformed UCX worker address: {verdict}")

    async def _verdict(self, key: bytes, address: bytes, error_handling: bool) -> str:
        async with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is None:
                verdict = await self._probe(address, error_handling)
                self._verdicts[key] = verdict
                while len(self._verdicts) > _VERDICTS_KEPT:
                    self._verdicts.popitem(last=False)
            return verdict

    async def _probe(self, address: bytes, error_handling: bool) -> str:
        try:
            proc = await asyncio.wait_for(self._child(), PROBE_TIMEOUT_S)
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(struct.pack(">IB", len(address), int(error_handling)) + address)
            await proc.stdin.drain()
            answer = await asyncio.wait_for(proc.stdout.readexactly(1), PROBE_TIMEOUT_S)
        except ProbeUnavailableError as exc:
            await self.close()
            log_event("ucx.probe_unavailable", logging.ERROR, detail=str(exc))
            return f"the address probe could not run ({exc}); local handoffs are unaffected"
        except (asyncio.IncompleteReadError, ConnectionError, RuntimeError, TimeoutError) as exc:
            self.crashes += 1
            await self.close()
            if isinstance(exc, TimeoutError):
                why = f"UCX did not unpack it within the probe's {PROBE_TIMEOUT_S}s"
            else:
                why = "unpacking it crashed UCX in the probe process"
            log_event("ucx.address_refused", logging.WARNING, detail=why)
            return why
        if answer != b"1":
            await self.close()
            return "the probe process answered out of turn"
        return ""

    async def _child(self) -> SpawnedChild:
        if self._proc is None or self._proc.returncode is not None:
            if self._starting is None or (self._starting.done() and self._proc is not None):
                self.start()  # never started, or the child it started has died since
            assert self._starting is not None
            self._proc = await self._starting
        return self._proc

    async def _spawn(self) -> SpawnedChild:
        # Run by path with -P: the child imports UCX and the standard library only (not this
        # package, which imports gRPC; a gRPC in the child crashed it in gRPC's poller).
        # posix_spawn, never fork: see .spawn.
        try:
            proc = await spawn_child([sys.executable, "-P", _CHILD])
        except OSError as exc:
            raise ProbeUnavailableError(f"cannot start {sys.executable}: {exc.strerror}") from None
        try:
            ready = await asyncio.wait_for(proc.stdout.readexactly(1), PROBE_START_S)
        except (asyncio.IncompleteReadError, TimeoutError):
            await _stop(proc)
            raise ProbeUnavailableError(f"the probe process did not start within {PROBE_START_S:g}s") from None
        except BaseException:
            await _stop(proc)
            raise
        if ready != b"R":
            await _stop(proc)
            raise ProbeUnavailableError("the probe process did not start")
        self._proc = proc
        return proc

    async def close(self) -> None:
        """Stop the child (the next check starts another)."""
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():
            starting.cancel()
            await asyncio.wait({starting})
        proc, self._proc = self._proc, None
        if proc is not None:
            await _stop(proc)


class ProbeUnavailableError(ConnectionError):
    """The probe child could not be started (or did not say it was ready in time)."""


async def _stop(proc: SpawnedChild) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have died (a probe crash) unreaped
        proc.kill()
    await proc.wait()
