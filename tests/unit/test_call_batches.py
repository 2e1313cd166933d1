"""An engine's ``Calls`` stream, served: calls that came in one message run as if each came
alone; the first answer to find the stream idle is written at once by its own call, and the
answers ready meanwhile go out in one write to a client that said it reads them, never to one
that did not (an older SDK would drop them).

The stream's context is an in-memory stand-in for gRPC's (reads from a list, records writes);
what runs is the daemon's own serving code with real handlers."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from kvxfer.batching import CALL_BATCHES, unbatched
from kvxfer.proto import common_pb2, engine_pb2
from kvxferd.control.call_stream import serve_calls


class _Context:
    """What serve_calls uses of a grpc.aio servicer context."""

    def __init__(self, requests: list[engine_pb2.CallRequest], metadata: tuple[tuple[str, str], ...]) -> None:
        self.requests, self.metadata = list(requests), metadata
        self.written: list[engine_pb2.CallResponse] = []
        self.initial: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def send_initial_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.initial = metadata

    async def read(self) -> Any:
        await asyncio.sleep(0)
        return self.requests.pop(0) if self.requests else grpc.aio.EOF

    async def write(self, response: engine_pb2.CallResponse) -> None:
        self.written.append(response)
        await asyncio.sleep(0)


def _offer(call_id: int) -> engine_pb2.CallRequest:
    return engine_pb2.CallRequest(call_id=call_id, offer=engine_pb2.OfferRequest(pool_id=f"p{call_id}"))


async def _served(requests: list[engine_pb2.CallRequest], batched: bool) -> _Context:
    gate, started = asyncio.Event(), []

    async def offer(request: engine_pb2.OfferRequest) -> engine_pb2.OfferResponse:
        started.append(request)
        if len(started) == 8:
            gate.set()
        await gate.wait()  # all eight finish at once: their answers are ready together
        return engine_pb2.OfferResponse(ticket=common_pb2.Ticket(offer_id=f"offer-{request.pool_id}"))

    context = _Context(requests, (CALL_BATCHES,) if batched else ())
    await asyncio.wait_for(serve_calls(context, {"offer": offer}), 5)
    return context


def _batch_of(*call_ids: int) -> engine_pb2.CallRequest:
    first = _offer(call_ids[0])
    first.more.extend(_offer(i) for i in call_ids[1:])
    return first


def test_calls_in_one_message_each_run_and_answers_ready_together_go_in_one_write_after_the_first() -> None:
    context = asyncio.run(_served([_batch_of(1, 2, 3, 4, 5), _batch_of(6, 7, 8)], batched=True))
    assert context.initial == (CALL_BATCHES,)  # the daemon says it reads batched calls
    answers = [a for w in context.written for a in unbatched(w)]
    assert sorted(a.call_id for a in answers) == list(range(1, 9))
    assert all(a.offer.ticket.offer_id == f"offer-p{a.call_id}" for a in answers)  # each its own call's
    # The first answer found the stream idle and went at once; the seven ready with it, in one.
    assert [len(list(unbatched(w))) for w in context.written] == [1, 7]


def test_a_client_that_did_not_ask_gets_one_answer_a_write() -> None:
    context = asyncio.run(_served([_batch_of(1, 2, 3, 4, 5, 6, 7, 8)], batched=False))
    assert len(context.written) == 8
    assert all(not w.more for w in context.written)
    assert sorted(w.call_id for w in context.written) == list(range(1, 9))
    assert all(w.WhichOneof("result") == "offer" for w in context.written)


def test_calls_nested_deeper_than_one_level_are_ignored() -> None:
    inner = _batch_of(2, 99)  # 99 rides two levels deep: never run, never answered
    outer = _batch_of(1)
    outer.more.append(inner)
    outer.more.extend(_offer(i) for i in range(3, 9))
    context = asyncio.run(_served([outer], batched=True))
    answers = [a for w in context.written for a in unbatched(w)]
    assert sorted(a.call_id for a in answers) == list(range(1, 9))
    assert all(a.WhichOneof("result") == "offer" for a in answers)
