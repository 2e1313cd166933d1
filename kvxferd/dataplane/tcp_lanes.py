"""TCP lanes: one transfer's chunks over several TCP connections at once, for peers whose
fastest common transport is TCP (clouds without RDMA).

UCX's TCP transport moves a large message over one connection, driven by one progress
thread: 1.2 GB/s for one 256 MiB host buffer between two processes here (``UCX_TLS=tcp``,
``bench.ucx_baseline``). Lanes open ``count`` connections per transfer and deal chunk *c* to
lane ``c % count``; each lane runs in a thread of its own (socket calls let go of the GIL),
gathering a fragmented chunk into its staging buffer (or sending a contiguous one from where
it lies) and, on the other side, receiving straight into the destination or into staging and
scattering it. A lane is a thread of its own rather than a pool's worker: lanes of two
transfers in opposite directions can then never wait on each other for a thread.

Who connects, and why it is safe: the receiving daemon connects to the offering daemon's lane
listener, at the host it dialled for that peer's gRPC service (never a host a peer names) and
the port the offering daemon's ``accepted`` gives, and proves the connection belongs to the
transfer with the 16-byte nonce from that same message (sent over the peer's authenticated
stream). Nothing is sent to a connection before its hello names a transfer waiting for that
lane. The bytes themselves are not encrypted (neither are UCX's).

Wire, per connection::

    receiver -> sender   hello: b"KVL1", lane (u16), count (u16), nonce (16 bytes)
    sender -> receiver   per chunk of the lane, in order: index (u32), bytes (u32), the bytes

>>> hello(b"n" * 16, 1, 4)[:8]
b'KVL1\\x01\\x00\\x04\\x00'
>>> lane_chunks(10, 2, 4)
[2, 6]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.errors import UnavailableError

from .._log import log_event
from .hostmem import HostMemory
from .plan import ChunkPlan, SidePlan

__all__ = [
    "HELLO_BYTES",
    "MAX_LANES",
    "Lane",
    "LaneListener",
    "LaneSet",
    "connect_lanes",
    "hello",
    "lane_chunks",
    "run_lanes",
    "split_address",
]

MAGIC = b"KVL1"
_HELLO = struct.Struct("<4sHH16s")
_HEADER = struct.Struct("<II")
HELLO_BYTES = _HELLO.size
#: Lanes one transfer may ask for.
MAX_LANES = 16
#: Connections whose hello has not arrived yet; more are closed at once.
MAX_PENDING = 64
#: Socket buffers asked for (the kernel caps them at net.core.[rw]mem_max).
SOCKET_BUFFER = 4 << 20


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts in brackets) as its parts.

    >>> split_address("10.0.0.7:7464"), split_address("[fd00::7]:0")
    (('10.0.0.7', 7464), ('fd00::7', 0))
    """
    host, port = address.rsplit(":", 1)
    return host.removeprefix("[").removesuffix("]"), int(port)


def hello(nonce: bytes, lane: int, count: int) -> bytes:
    return _HELLO.pack(MAGIC, lane, count, nonce)


def lane_chunks(num_chunks: int, lane: int, count: int) -> list[int]:
    """The chunks lane ``lane`` of ``count`` carries, in order."""
    return list(range(lane, num_chunks, count))


@dataclass
class LaneSet:
    """The lanes of one transfer on the sending side, as their connections arrive."""

    nonce: bytes
    count: int
    sockets: list[socket.socket | None] = field(init=False)
    #: Set once every lane is connected.
    complete: asyncio.Future[None] = field(init=False)

    def __post_init__(self) -> None:
        self.sockets = [None] * self.count
        self.complete = asyncio.get_running_loop().create_future()

    def attach(self, lane: int, sock: socket.socket) -> bool:
        if self.complete.done() or self.sockets[lane] is not None:
            return False
        self.sockets[lane] = sock
        if all(s is not None for s in self.sockets):
            self.complete.set_result(None)
        return True

    async def connected(self, timeout_s: float) -> list[socket.socket]:
        """Every lane, once its receiver connected (UnavailableError past ``timeout_s``)."""
        try:
            await asyncio.wait_for(asyncio.shield(self.complete), timeout_s)
        except TimeoutError:
            arrived = sum(s is not None for s in self.sockets)
            raise UnavailableError(
                f"{arrived} of {self.count} TCP lanes connected within {timeout_s}s: is the lane port reachable "
                "from the receiving daemon (tcp_lanes_listen)?"
            ) from None
        return [s for s in self.sockets if s is not None]

    def close(self) -> None:
        if not self.complete.done():
            self.complete.cancel()
        _shut(self.sockets)


class LaneListener:
    """The offering daemon's lane port: accepts connections and hands each, once its hello
    names a transfer that expects it, to that transfer's :class:`LaneSet`."""

    def __init__(self, hello_timeout_s: float) -> None:
        self.hello_timeout_s = hello_timeout_s
        self.port = 0
        self._sock: socket.socket | None = None
        self._expected: dict[bytes, LaneSet] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None

    def start(self, address: str) -> str:
        """Listen on ``host:port`` (port 0: a free one); returns the address taken. Raises
        OSError or ValueError when it cannot be."""
        host, port = split_address(address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        self._sock, self.port = sock, sock.getsockname()[1]
        self._accepting = asyncio.ensure_future(self._accept())
        return f"{address.rsplit(':', 1)[0]}:{self.port}"

    def expect(self, nonce: bytes, count: int) -> LaneSet:
        lanes = LaneSet(nonce, count)
        self._expected[nonce] = lanes
        return lanes

    def forget(self, lanes: LaneSet) -> None:
        if self._expected.get(lanes.nonce) is lanes:
            del self._expected[lanes.nonce]
        lanes.close()

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._pending):
            task.cancel()
        for lanes in list(self._expected.values()):
            self.forget(lanes)
        if self._sock is not None:
            self._sock.close()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # e.g. out of descriptors: keep serving the others
                log_event("lanes.accept_failed", logging.WARNING, error=repr(exc))
                await asyncio.sleep(0.1)
                continue
            if len(self._pending) >= MAX_PENDING:
                conn.close()
                continue
            task = asyncio.ensure_future(self._hello(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _hello(self, conn: socket.socket) -> None:
        """Read a connection's hello (bounded in time and size) and attach it, or close it."""
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        why = ""
        try:
            data = b""
            async with asyncio.timeout(self.hello_timeout_s):
                while len(data) < HELLO_BYTES:
                    more = await loop.sock_recv(conn, HELLO_BYTES - len(data))
                    if not more:
                        break
                    data += more
            if len(data) < HELLO_BYTES:
                why = "closed before its hello"
            else:
                magic, lane, count, nonce = _HELLO.unpack(data)
                lanes = self._expected.get(nonce) if magic == MAGIC else None
                if lanes is None or lanes.count != count or lane >= count:
                    why = "a hello naming no transfer that waits for it"
                elif not lanes.attach(lane, conn):
                    why = "a lane already connected"
                else:
                    _tune(conn)
        except TimeoutError:
            why = f"no hello within {self.hello_timeout_s}s"
        except OSError as exc:
            why = repr(exc)
        except asyncio.CancelledError:
            conn.close()
            raise
        if why:
            log_event("lanes.refused", logging.INFO, reason=why)
            conn.close()


async def connect_lanes(host: str, port: int, nonce: bytes, count: int, timeout_s: float) -> list[socket.socket]:
    """The receiving side: open ``count`` lanes to the offering daemon and say hello on each."""
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, address = infos[0]
            for lane in range(count):
                sock = socket.socket(family, socket.SOCK_STREAM)
                socks.append(sock)
                _tune(sock)
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
                await loop.sock_sendall(sock, hello(nonce, lane, count))
    except (OSError, TimeoutError) as exc:
        _shut(socks)
        raise UnavailableError(f"TCP lanes to {host}:{port}: {exc!r}") from None
    return socks


async def run_lanes(
    lane: Callable[[socket.socket, int], None],
    socks: list[socket.socket],
    what: str,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Run ``lane(sock, index)`` for every lane, each in a thread of its own. The first to fail
    (or a cancellation) shuts every socket down, which ends the others' blocking calls, and
    calls ``on_stop`` (for waits of their own); every thread has returned when this does."""
    loop = asyncio.get_running_loop()
    futures = [_in_thread(loop, f"kvxfer-lane-{what}-{i}", lane, sock, i) for i, sock in enumerate(socks)]
    try:
        done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise _unavailable(f.exception(), what)
        await asyncio.gather(*futures)
    except BaseException:
        _shut(socks)
        if on_stop is not None:
            on_stop()
        await asyncio.wait(futures)  # the threads see their sockets shut and return
        for f in futures:
            f.exception()  # retrieved: the first failure is the one raised
        raise
    finally:
        for sock in socks:
            sock.close()


@dataclass(frozen=True)
class Lane:
    """One connection of a transfer's lanes: lane ``index`` of ``count`` carries chunks
    ``index``, ``index + count``, ...; a peer that stalls it ``timeout_s`` fails it."""

    sock: socket.socket
    index: int
    count: int
    timeout_s: float

    def chunks(self, plan: SidePlan) -> list[int]:
        self.sock.setblocking(True)
        self.sock.settimeout(self.timeout_s)  # a peer that stops fails the lane, not hangs it
        return lane_chunks(len(plan.chunks), self.index, self.count)


def send_lane(
    lane: Lane, plan: SidePlan, memory: HostMemory, scratch: Any, after_chunk: Callable[[int], None] | None = None
) -> None:
    """One lane's chunks of ``plan`` from ``memory`` (``scratch``: a chunk-sized buffer for
    the ones that must be gathered); ``after_chunk(c)`` runs once chunk ``c`` is sent."""
    sock = lane.sock
    for c in lane.chunks(plan):
        chunk = plan.chunks[c]
        view = _contiguous(memory, chunk)
        if view is None:
            memory.gather(chunk, scratch)
            view = memoryview(scratch)[: chunk.nbytes]
        sock.sendall(_HEADER.pack(c, chunk.nbytes))
        sock.sendall(view)
        if after_chunk is not None:
            after_chunk(c)


def receive_lane(lane: Lane, plan: SidePlan, memory: HostMemory, scratch: Any) -> None:
    """One lane's chunks of ``plan`` into ``memory``, each header checked against the plan
    before a byte of it is taken (a peer sends what this side expects, or the lane fails)."""
    sock = lane.sock
    header = bytearray(_HEADER.size)
    for c in lane.chunks(plan):
        chunk = plan.chunks[c]
        _receive_into(sock, memoryview(header))
        got_index, nbytes = _HEADER.unpack(header)
        if got_index != c or nbytes != chunk.nbytes:
            raise UnavailableError(
                f"lane {lane.index} brought chunk {got_index} of {nbytes} bytes; chunk {c} of {chunk.nbytes} was due"
            )
        view = _contiguous(memory, chunk)
        _receive_into(sock, view if view is not None else memoryview(scratch)[: chunk.nbytes])
        if view is None:
            memory.scatter(chunk, scratch)


def _receive_into(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise UnavailableError("the peer closed a TCP lane mid-transfer")
        view = view[n:]


def _contiguous(memory: HostMemory, chunk: ChunkPlan) -> memoryview | None:
    """The chunk where it lies, when it is one range of memory mapped in this process."""
    arrays = getattr(memory, "arrays", None)
    if arrays is None or chunk.contiguous is None:
        return None
    buffer, offset = chunk.contiguous
    return memoryview(arrays[buffer][offset : offset + chunk.nbytes])


def _in_thread(loop: asyncio.AbstractEventLoop, name: str, fn: Callable[..., None], *args: Any) -> asyncio.Future[None]:
    """``fn(*args)`` in a thread of its own, as a future of the loop."""
    future: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(None)

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, raised there (else it waits forever)
            loop.call_soon_threadsafe(settle, exc)
        else:
            loop.call_soon_threadsafe(settle, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _unavailable(exc: BaseException | None, what: str) -> BaseException:
    if isinstance(exc, OSError):  # TimeoutError among them: a socket's timeout
        return UnavailableError(f"TCP lane ({what}): {exc!r}")
    return exc if exc is not None else UnavailableError(f"TCP lane ({what}) failed")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)


def _shut(socks: Sequence[socket.socket | None]) -> None:
    for sock in socks:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
