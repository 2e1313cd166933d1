"""Block checksums end to end (kvxferd/_integrity.py): what an offer held when it was
written is what lands, or the pull fails with DataLossError naming the blocks. Real daemons;
remote pulls over UCX and over same-host direct reads, and local copies. Bits are flipped
"in flight" with the ``before_check=corrupt`` fault point; an engine reusing an offered block
too early is an engine writing into it after its offer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from bench.cluster import Cluster, Daemon
from kvxfer.proto import common_pb2
from kvxfer_client import (
    AsyncKvxferClient,
    DataLossError,
    HostBuffer,
    IncompatibleError,
    KvGeometry,
    Layout,
    ModelInfo,
    Pool,
    ReleaseReason,
)

LAYOUT = Layout.paged_kv(num_layers=2, num_blocks=32, block_bytes=8 << 10)
SRC, DST = [3, 9, 1, 20, 7, 11], [0, 5, 6, 30, 2, 8]
FULL = ("--integrity", "full", "--log-level", "debug")
CORRUPT = ("--fault-injection", "--faults", "before_check=corrupt")


def _env(path: str) -> dict[str, str]:
    return {"KVXFERD_SAME_HOST_DIRECT_READ": "true" if path == "direct" else "false"}


async def _pools(p: AsyncKvxferClient, d: AsyncKvxferClient) -> tuple[Pool, Pool]:
    src = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    for i, buf in enumerate(src):
        buf.array()[:] = np.random.default_rng(i).integers(0, 256, buf.size, dtype=np.uint8)
    dst = [HostBuffer.create(s) for s in LAYOUT.buffer_sizes()]
    return await p.register_pool(src, LAYOUT), await d.register_pool(dst, LAYOUT)


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


@pytest.fixture
async def pair(cluster: Cluster, request: pytest.FixtureRequest) -> AsyncIterator[tuple[Daemon, Daemon]]:
    """(offering, decode) daemons in full mode for a path: remote over UCX, remote by direct
    reads, or local (both engines on one daemon); ``corrupt`` arms the corrupting fault."""
    path, corrupt = request.param
    extra = CORRUPT if corrupt else ()
    a = cluster.daemon("a", *FULL, *extra, env=_env(path))
    yield (a, a) if path == "local" else (a, cluster.daemon("b", *FULL, *extra, env=_env(path)))


PATHS = ["ucx", "direct", "local"]


@pytest.mark.parametrize("pair", [(p, False) for p in PATHS], indirect=True, ids=PATHS)
async def test_every_block_is_checked_in_full_mode_and_the_records_say_so(
    pair: tuple[Daemon, Daemon], request: pytest.FixtureRequest
) -> None:
    a, b = pair
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src, dst = await _pools(p, d)
        ticket = await p.offer(src, SRC)
        result = await d.pull(ticket, dst, DST, transfer_id="checked-1")
        row = b.transfer("checked-1")
        path = {"direct:cma": "direct", "local-copy": "local"}.get(row.transport, "ucx")
        assert path == request.node.callspec.id, row.transport  # the path this case is about
        assert (row.integrity_mode, row.integrity_blocks, row.integrity_result) == ("full", len(SRC), "ok"), row
        if a is not b:  # the offering daemon's record: full mode leaves every byte to the receiver
            served = a.transfer("checked-1")
            assert (served.integrity_mode, served.integrity_blocks, served.integrity_result) == ("full", 6, "sent")
        assert f"integrity=full:{len(SRC)}:ok" in b.log()
        assert result.bytes == len(SRC) * LAYOUT.bytes_per_block


@pytest.mark.parametrize("pair", [(p, True) for p in PATHS], indirect=True, ids=PATHS)
async def test_a_bit_flipped_on_the_way_fails_the_pull_naming_the_block(pair: tuple[Daemon, Daemon]) -> None:
    """The fault flips one bit of the first landed block before the check: the pull fails with
    DataLossError naming that block, the offer is released as failed, nothing reports success."""
    a, b = pair
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src, dst = await _pools(p, d)
        ticket = await p.offer(src, SRC)
        with pytest.raises(DataLossError, match=rf"blocks \[{DST[0]}\] \(positions \[0\]"):
            await d.pull(ticket, dst, DST, transfer_id="flipped-1")
        released = await p.wait_released(ticket.offer_id, 10)
        assert released.reason is ReleaseReason.FAILED
        row = b.transfer("flipped-1")
        assert row.state == common_pb2.TRANSFER_STATE_FAILED and row.integrity_result == "mismatch", row
        assert "fault.hit point=before_check action=corrupt" in b.log()


@pytest.mark.parametrize("blocks", [6, 2])
@pytest.mark.parametrize("mode", ["sampled", "full"])
@pytest.mark.parametrize("path", PATHS)
async def test_a_block_written_again_after_its_offer_is_not_shipped_under_the_old_request(
    cluster: Cluster, path: str, mode: str, blocks: int
) -> None:
    """The engine reuses an offered block (writes one layer's V of it) before the pull: the
    transfer fails naming the block instead of delivering new contents under the old request
    (every segment sampled here: 6 blocks x 4 regions < 32; 2 blocks are a few segments,
    summed whole where they lie). The check where it lands finds it; the offering daemon,
    summing its source again only then, tells the engine it was the engine's own write, not
    the way."""
    extra = ("--integrity", mode, "--integrity-samples", "32", "--log-level", "debug")
    a = cluster.daemon("a", *extra, env=_env(path))
    b = a if path == "local" else cluster.daemon("b", *extra, env=_env(path))
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src, dst = await _pools(p, d)
        ticket = await p.offer(src, SRC[:blocks])
        await _until(lambda: f"integrity.digest offer_id={ticket.offer_id}" in a.log(), "the offer was never summed")
        reused = SRC[blocks - 1]
        region = LAYOUT.regions[1]
        start = region.offset + reused * region.block_stride
        src.buffers[region.buffer_index].array()[start : start + 64] ^= 0xFF  # another request's KV
        with pytest.raises(DataLossError, match=rf"blocks \[{reused}\] changed after they were offered"):
            await d.pull(ticket, dst, DST[:blocks])
        assert (await p.wait_released(ticket.offer_id, 10)).reason is ReleaseReason.FAILED


async def test_sampled_mode_catches_a_corrupt_segment_at_the_rate_it_samples(cluster: Cluster) -> None:
    """8 windows per offer of 32 segments (16 blocks, K and V of one layer; 4 segments in each
    eighth of the offer, each window a whole segment of its eighth), the first segment
    corrupted every time: about a quarter of the pulls fail (binomial, 60 pulls: outside 4..28
    has odds under 1e-4), and every one that fails names block position 0."""
    a = cluster.daemon("a", "--integrity", "sampled", "--integrity-samples", "8", *CORRUPT)
    layout = Layout.paged_kv(num_layers=1, num_blocks=64, block_bytes=4 << 10)
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(a.socket, engine_name="decode") as d,
    ):
        src = await p.register_pool([HostBuffer.create(s) for s in layout.buffer_sizes()], layout)
        dst = await d.register_pool([HostBuffer.create(s) for s in layout.buffer_sizes()], layout)
        caught = 0
        for _ in range(60):
            ticket = await p.offer(src, list(range(16)))
            try:
                await d.pull(ticket, dst, list(range(16, 32)))
            except DataLossError as exc:
                assert "(positions [0]" in str(exc), exc
                caught += 1
    assert 4 <= caught <= 28, caught


@pytest.mark.parametrize("path", ["ucx", "local"])
async def test_with_integrity_off_the_records_say_why_nothing_was_checked(cluster: Cluster, path: str) -> None:
    """The offering daemon's reason reaches the receiver's record too (with BlockSums.unchecked)."""
    a = cluster.daemon("a", "--integrity", "off", env=_env(path))
    b = a if path == "local" else cluster.daemon("b", env=_env(path))
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src, dst = await _pools(p, d)
        await d.pull(await p.offer(src, SRC), dst, DST, transfer_id="off-1")
        why = "integrity is off on the offering daemon"
        assert a.transfer("off-1").integrity_result == f"not checked: {why}"
        if b is not a:
            assert b.transfer("off-1").integrity_result == f"not checked: no sums from the offering daemon ({why})"


@pytest.mark.parametrize("path", ["ucx", "local"])
async def test_pools_whose_kv_format_differs_never_exchange_blocks(cluster: Cluster, path: str) -> None:
    """Layout drift: two engine versions with the same block sizes but another in-block layout
    (ModelInfo.kv_format) get different fingerprints, and a pull between them is refused
    naming both formats, before a byte moves."""
    a = cluster.daemon("a", env=_env(path))
    b = a if path == "local" else cluster.daemon("b", env=_env(path))
    formats = ("eng/1 [B,2,16,256] x2", "eng/2 [B,16,2,256] x2", "")
    layouts = [
        Layout.paged_kv(num_layers=2, num_blocks=32, block_bytes=8 << 10, model=ModelInfo("m", "bf16", 16, kv_format=f))
        for f in formats
    ]
    assert len({layout.fingerprint() for layout in layouts}) == 3
    new_layout = layouts[1]
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        src = await p.register_pool([HostBuffer.create(s) for s in layouts[0].buffer_sizes()], layouts[0])
        dst = await d.register_pool([HostBuffer.create(s) for s in new_layout.buffer_sizes()], new_layout)
        ticket = await p.offer(src, SRC)
        # The decode daemon refuses on the fingerprint; on one daemon it names the difference.
        said = r"KV format differs: 'eng/1 \[B,2,16,256\] x2' vs 'eng/2" if path == "local" else "KV format"
        with pytest.raises(IncompatibleError, match=f"layout fingerprint mismatch: .*{said}"):
            await d.pull(ticket, dst, DST)
        # Refused before a byte moved: the offer is still there for an engine of its own format.
        same = await d.register_pool([HostBuffer.create(s) for s in layouts[0].buffer_sizes()], layouts[0])
        assert (await d.pull(ticket, same, DST)).bytes == len(SRC) * layouts[0].bytes_per_block


@pytest.mark.parametrize("path", PATHS)
async def test_a_remapped_pull_is_checked_where_it_lands(cluster: Cluster, path: str) -> None:
    """Another head order (HND offered, NHD destination): the blocks are cut otherwise where
    they land, so the stream is summed by windows on both sides. A bit flipped on the way
    fails the pull naming the destination blocks under its window (one: the whole stream); a
    clean pull is checked on both sides; a block written after its offer still fails the pull
    at the source."""
    flip = ("--fault-injection", "--faults", "before_check=corrupt:1")
    a = cluster.daemon("a", "--integrity-samples", "64", "--log-level", "debug", *flip, env=_env(path))
    b = a if path == "local" else cluster.daemon("b", *flip, env=_env(path))
    model = ModelInfo("m", "bf16", 16)
    src_layout, dst_layout = (
        Layout.paged_kv(num_layers=1, num_blocks=8, block_bytes=8192, model=model, geometry=KvGeometry(16, 2, 256, o))
        for o in ("HND", "NHD")
    )
    async with (
        AsyncKvxferClient(a.socket, engine_name="prefill") as p,
        AsyncKvxferClient(b.socket, engine_name="decode") as d,
    ):
        buffers = [HostBuffer.create(s) for s in src_layout.buffer_sizes()]
        buffers[0].array()[:] = np.random.default_rng(3).integers(0, 256, buffers[0].size, dtype=np.uint8)
        src = await p.register_pool(buffers, src_layout)
        dst = await d.register_pool([HostBuffer.create(s) for s in dst_layout.buffer_sizes()], dst_layout)
        ticket = await p.offer(src, [1, 2, 3])
        with pytest.raises(
            DataLossError, match=r"blocks \[4, 5, 6\] \(bytes \[0\] onwards, 65536 each, of the remapped"
        ):
            await d.pull(ticket, dst, [4, 5, 6], transfer_id="remap-flipped")
        assert b.transfer("remap-flipped").integrity_result == "mismatch"

        result = await d.pull(await p.offer(src, [1, 2, 3]), dst, [4, 5, 6], transfer_id="remap-1")
        assert result.mapping, result
        row = b.transfer("remap-1")
        path_taken = {"direct:cma": "direct", "local-copy": "local"}.get(row.transport, "ucx")
        assert path_taken == path, row.transport
        # One 64 KiB window holds the whole stream: every destination block is checked.
        assert (row.integrity_mode, row.integrity_blocks, row.integrity_result) == ("sampled", 3, "ok"), row
        if b is not a:
            assert a.transfer("remap-1").integrity_result == "ok"  # the source's own check

        ticket = await p.offer(src, [1, 2, 3])
        await _until(lambda: f"integrity.digest offer_id={ticket.offer_id}" in a.log(), "the offer was never summed")
        buffers[0].array()[2 * 8192 : 2 * 8192 + 64] ^= 0xFF  # block 2's K, written again
        with pytest.raises(DataLossError, match=r"blocks \[2\] changed after they were offered"):
            await d.pull(ticket, dst, [4, 5, 6])
