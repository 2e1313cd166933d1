"""An error's typed fields cross the wire: the daemon's error mapping (``rpc_method`` for
unary calls, the Calls stream's answers) on a real in-process gRPC server, read back by the
SDK's own conversion. The servicer only raises; what is under test is the transport."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kvxfer.errors import UnavailableError, error_from_rpc
from kvxfer.proto import engine_pb2, engine_pb2_grpc
from kvxfer_client._call_stream import CallStream
from kvxferd.control.call_stream import serve_calls
from kvxferd.edge.rpc import rpc_method


def _failed_pull() -> UnavailableError:
    return UnavailableError("peer gone", transfer_id="t-7", offer_id="off-9", may_still_write=True)


class _Failing(engine_pb2_grpc.EngineServiceServicer):
    @rpc_method
    async def Pull(self, request: engine_pb2.PullRequest, context: Any) -> engine_pb2.PullResponse:  # noqa: N802
        raise _failed_pull()

    @rpc_method
    async def Calls(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]  # noqa: N802
        async def pull(request: engine_pb2.PullRequest) -> engine_pb2.PullResponse:
            raise _failed_pull()

        await serve_calls(context, {"pull": pull})


@pytest.fixture
async def stub() -> AsyncIterator[engine_pb2_grpc.EngineServiceStub]:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(_Failing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)
    await server.stop(None)


def _check(err: BaseException) -> None:
    assert type(err) is UnavailableError and str(err) == "peer gone"
    assert (err.transfer_id, err.offer_id, err.may_still_write) == ("t-7", "off-9", True)


async def test_a_unary_pulls_error_keeps_its_fields(stub: engine_pb2_grpc.EngineServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        await stub.Pull(engine_pb2.PullRequest(), timeout=10)
    _check(error_from_rpc(failure.value))


async def test_a_streamed_pulls_error_keeps_its_fields(stub: engine_pb2_grpc.EngineServiceStub) -> None:
    calls = CallStream(stub)
    with pytest.raises(UnavailableError) as failure:
        await calls.call("pull", engine_pb2.PullRequest(), 10)
    _check(failure.value)
    await calls.close()
