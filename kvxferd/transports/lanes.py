"""Remote handoffs over TCP lanes (:mod:`..dataplane.tcp_lanes`): both ends of one transfer.

The receiving daemon asks for lanes in its ``start`` (``TransferStart.tcp_lanes``) when its
``tcp_lanes`` setting says so for this peer: ``auto`` when UCX would carry host memory to it
over TCP (no shared memory or RDMA in common), ``always`` for every remote pull between host
pools that is not a direct read. The offering daemon answers with the lanes' port and a fresh
nonce in ``accepted`` (host pools only: a GPU pool, or a stream sent layer by layer, goes over
UCX as usual), the receiver connects, and the chunks flow. Steps, outcomes and integrity
checks are the same as over UCX: only the bytes take another road.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

from kvxfer.errors import IncompatibleError
from kvxfer.proto import peer_pb2

from .._config import Settings
from .._faults import Faults
from .._offers import Offer
from .._services import Services
from .._transfers import TransferRecord
from ..dataplane.plan import SidePlan, build_plan
from ..dataplane.tcp_lanes import MAX_LANES, Lane, connect_lanes, receive_lane, run_lanes, send_lane, split_address
from ..memory.pools import Pool
from ..peer.directory import Peer
from .direct_proof import NONCE_BYTES, new_nonce
from .faces import Landing, Receiver, Sender
from .plane import RemotePlane

__all__ = ["TCP_LANES", "LaneHandoff", "lanes_to_ask"]

#: The transport name in records, metrics and logs (``tcp-lanes:<count>``).
TCP_LANES = "tcp-lanes"


def lanes_to_ask(settings: Settings, transport: str, dst: Pool, direct_read: bool) -> int:
    """The lanes a pull into ``dst`` asks for (0: none), given UCX's transport to the peer.

    >>> from kvxferd._config import Settings
    >>> class HostPool:
    ...     on_gpu = False
    >>> lanes_to_ask(Settings(), "ucx:tcp", HostPool(), False), lanes_to_ask(Settings(), "ucx:shm", HostPool(), False)
    (4, 0)
    """
    if settings.tcp_lanes == "off" or dst.on_gpu or direct_read:
        return 0
    if settings.tcp_lanes == "auto" and transport != "ucx:tcp":
        return 0
    return settings.tcp_lane_count


class LaneHandoff:
    def __init__(self, settings: Settings, plane: RemotePlane, faults: Faults) -> None:
        self.settings = settings
        self.plane = plane
        self.faults = faults

    async def send(
        self,
        asked: int,
        pool: Pool,
        plan: SidePlan,
        record: TransferRecord,
        announce: Callable[[peer_pb2.TcpLanes], Awaitable[None]],
        offer: Offer,
    ) -> None:
        """The offering side: ``announce`` the lanes (the transfer's ``accepted``), wait for
        the receiver to connect them, then send every chunk of ``plan`` once the offer is
        written."""
        listener = self.plane.lanes
        assert listener is not None, "lanes are served only where the listener runs"
        staging, staged = self.plane.lane_staging(pool, plan, "send")
        count = min(asked, MAX_LANES, staging.capacity if staged else MAX_LANES)
        lanes = listener.expect(new_nonce(), count)
        try:
            async with staging.lease(count if staged else 0) as lease:
                record.transport = f"{TCP_LANES}:{count}"
                record.mark("staging")
                await announce(peer_pb2.TcpLanes(port=listener.port, nonce=lanes.nonce, count=count))
                await self.faults.hit("after_accepted", transfer_id=record.transfer_id)
                socks = await lanes.connected(self.settings.peer_timeout_s)
                record.mark("lanes")
                await offer.wait_ready(offer.layers)  # a layer-wise offer moving whole: once written
                memory, after_chunk = pool.host_memory(), self.plane.chunk_fault_in_thread(record.transfer_id)
                buffers = lease.buffers or [None] * count
                timeout_s = self.settings.peer_timeout_s

                def lane(sock: socket.socket, index: int) -> None:
                    send_lane(Lane(sock, index, count, timeout_s), plan, memory, buffers[index], after_chunk)

                stop = after_chunk.cancel if after_chunk is not None else None
                await run_lanes(lane, socks, f"send {record.transfer_id}", stop)
        finally:
            listener.forget(lanes)

    async def receive(
        self, peer: Peer, described: peer_pb2.TcpLanes, asked: int, dst: Pool, plan: SidePlan, record: TransferRecord
    ) -> None:
        """The receiving side: connect the lanes ``described`` (checked against what this pull
        asked for) at the host this daemon dialled for ``peer``, and land every chunk of
        ``plan`` in ``dst``."""
        count = described.count
        if not 1 <= count <= asked or len(described.nonce) != NONCE_BYTES or not 0 < described.port < 65536:
            raise IncompatibleError(
                f"peer {peer.daemon_id} described {count} TCP lanes on port {described.port}: "
                f"this pull asked for 1..{asked} lanes with a {NONCE_BYTES}-byte nonce"
            )
        record.transport = f"{TCP_LANES}:{count}"
        self.plane.tell_lanes_once(peer, count)
        host, _ = split_address(peer.address)
        socks = await connect_lanes(host, described.port, bytes(described.nonce), count, self.settings.peer_timeout_s)
        record.mark("lanes")
        staging, staged = self.plane.lane_staging(dst, plan, "receive")
        async with staging.lease(count if staged else 0) as lease:
            memory, timeout_s = dst.host_memory(), self.settings.peer_timeout_s
            buffers = lease.buffers or [None] * count
            if staged and len(buffers) < count:
                raise IncompatibleError(
                    f"{count} TCP lanes need {count} staging buffers; this daemon has {len(buffers)}"
                )

            def lane(sock: socket.socket, index: int) -> None:
                receive_lane(Lane(sock, index, count, timeout_s), plan, memory, buffers[index])

            await run_lanes(lane, socks, f"receive {record.transfer_id}")


class LaneReceive(Receiver):
    def __init__(
        self, landing: Landing, services: Services, plane: RemotePlane, described: peer_pb2.TcpLanes, asked: int
    ) -> None:
        super().__init__(landing, services)
        self.plane, self.described, self.asked = plane, described, asked

    async def land(self) -> None:
        t = self.landing
        lanes = LaneHandoff(self.services.settings, self.plane, self.services.faults)
        await lanes.receive(t.peer, self.described, self.asked, t.dst, t.plan, t.record)


class LaneSend(Sender):
    async def send(self) -> None:
        t = self.sending
        pool = t.offer.pool
        plan = t.plan or build_plan(pool.regions, t.src_ids, t.chunk)
        signature, count = pool.layout.signature(), len(plan.chunks)

        async def announce(lanes: peer_pb2.TcpLanes) -> None:
            accepted = peer_pb2.TransferAccepted(
                total_bytes=t.record.nbytes,
                num_chunks=count,
                chunk_bytes=t.chunk,
                sender_signature=signature,
                lanes=lanes,
            )
            await t.stream.accepted(accepted)

        lanes = LaneHandoff(self.services.settings, self.plane, self.services.faults)
        await lanes.send(t.start.tcp_lanes, pool, plan, t.record, announce, t.offer)
