"""Another process's memory, as the daemon reaches an engine's: who it is comes from the socket,
the ranges are checked against its mappings, the bytes move with process_vm_readv/writev, and
nothing is touched once it has exited."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvxfer.errors import InvalidRequestError, PermissionDeniedError, UnavailableError
from kvxferd.dataplane.cma import self_copy_works
from kvxferd.dataplane.hostmem import MappedMemory, ProcessMemory, copy_between
from kvxferd.dataplane.plan import RegionTable, build_plan
from kvxferd.memory.process import EngineProcess, attach_peer

pytestmark = pytest.mark.skipif(not self_copy_works(), reason="process_vm_readv is refused here")

N = 1 << 16
CHILD = """
import socket, sys
import numpy as np
a = np.arange({n}, dtype=np.uint32).view(np.uint8)[:{n}].copy()
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
print(a.ctypes.data, flush=True)
for line in sys.stdin:  # "dump": print the array's bytes as hex
    print(a.tobytes().hex(), flush=True)
"""


class Child:
    """A process holding a numpy array, connected to us like an engine on the fd socket."""

    def __init__(self, tmp_path: Any) -> None:
        path = str(tmp_path / "fds")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(1)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(n=N), path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.conn, _ = self.listener.accept()
        assert self.proc.stdout is not None
        self.address = int(self.proc.stdout.readline())

    def dump(self) -> bytes:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("dump\n")
        self.proc.stdin.flush()
        return bytes.fromhex(self.proc.stdout.readline().strip())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()
        self.listener.close()


@pytest.fixture
def child(tmp_path: Any) -> Iterator[Child]:
    c = Child(tmp_path)
    yield c
    c.close()


def test_the_process_is_the_one_that_connected_and_its_ranges_are_checked(child: Child) -> None:
    process = attach_peer(child.conn)
    assert process.pid == child.proc.pid
    process.check_ranges([(child.address, N)])
    with pytest.raises(InvalidRequestError, match="not mapped"):
        process.check_ranges([(0x1000, 4096)])
    with pytest.raises(InvalidRequestError, match="not a memory range"):
        process.check_ranges([(child.address, 0)])


def test_blocks_move_both_ways_between_the_daemon_and_the_process(child: Child) -> None:
    process = attach_peer(child.conn)
    regions = RegionTable.from_regions([(0, 0, 1024, 300), (0, 300, 1024, 700)])  # 64 blocks of 1 KiB
    ids = np.array([5, 0, 63, 17])
    plan = build_plan(regions, ids, 512)  # chunks cut inside segments
    there = ProcessMemory(process.pid, np.array([child.address]), process.check)
    original = child.dump()

    mine = np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8)
    here = MappedMemory([mine])
    for chunk in plan.chunks:
        copy_between(here, chunk, there, chunk, None, single_pass=True)  # process_vm_writev
    after = np.frombuffer(child.dump(), dtype=np.uint8)
    touched = np.zeros(N, dtype=bool)
    for b in ids:
        touched[b * 1024 : b * 1024 + 1000] = True
    assert (after[touched] == mine[touched]).all()
    assert (after[~touched] == np.frombuffer(original, dtype=np.uint8)[~touched]).all()

    back = np.zeros(N, dtype=np.uint8)
    for chunk in plan.chunks:
        copy_between(there, chunk, MappedMemory([back]), chunk, None, single_pass=True)  # process_vm_readv
    assert (back[touched] == mine[touched]).all() and not back[~touched].any()


def test_nothing_is_touched_once_the_process_exited_or_the_session_ended(child: Child) -> None:
    process = attach_peer(child.conn)
    plan = build_plan(RegionTable.from_regions([(0, 0, 4096, 4096)]), np.array([0]), 4096)
    there = ProcessMemory(process.pid, np.array([child.address]), process.check)
    out = np.zeros(4096, dtype=np.uint8)
    process.hold()  # a pool registered from it
    there.gather(plan.chunks[0], out)
    child.proc.kill()
    child.proc.wait()  # reaped: the pid is free for the kernel to hand out again
    assert process.exited()
    with pytest.raises(UnavailableError, match="exited"):
        there.gather(plan.chunks[0], out)
    with pytest.raises(UnavailableError, match="exited"):
        process.check_ranges([(child.address, 4096)])
    process.end()
    with pytest.raises(UnavailableError, match=r"session of pid \d+ ended"):
        there.gather(plan.chunks[0], out)
    process.release()  # the last pool closed: the pidfd goes
    assert process.exited()


def test_a_second_attachment_of_another_process_is_refused(child: Child) -> None:
    from kvxferd._sessions import Session

    session = Session("engine")
    session.attach(attach_peer(child.conn))
    other = EngineProcess(pid=1, pidfd=-1, uid=0)  # a process that learned the session id
    with pytest.raises(PermissionDeniedError, match="attached to engine process"):
        session.attach(other)
    assert session.process is not None and session.process.pid == child.proc.pid


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_registering_cpu_tensors_asks_for_huge_pages_on_their_whole_2mib_pages() -> None:
    import mmap

    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages are off on this kernel")
    from kvxfer_client._host_tensor import advise_huge_pages

    region = mmap.mmap(-1, 10 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(region, dtype=np.uint8)
    arr[:] = 1  # faulted in as 4 KiB pages (no advice yet)
    before = _anon_huge_kb()
    start = arr.ctypes.data + 4096  # not on a 2 MiB boundary: only whole huge pages inside count
    advised = advise_huge_pages(start, (8 << 20) + 8192)
    assert advised in (6 << 20, 8 << 20)  # 3 or 4 whole 2 MiB pages, by where the mapping fell
    assert _anon_huge_kb() - before >= advised >> 10  # collapsed now, not some day
    assert (arr == 1).all()  # the contents stay
    del arr
    region.close()
