"""``EngineService.Calls``: an engine's unary calls multiplexed on one long-lived stream.

A unary gRPC call pays for its own set-up, headers and trailers; a message on a stream that is
already open costs about half as much (on the dev VM: 0.49 ms against 0.24 ms per round
trip, ``grpc.aio`` over a Unix socket). Offer and Pull sit on the critical path of
time-to-first-token, so the SDK sends them here.

Each request runs as its own task, exactly as the unary method would (same handler, same
errors), and its answer is written as soon as it is ready: answers come back in completion
order with the request's ``call_id``. gRPC allows one write at a time per stream: a call
whose answer finds the stream idle writes it itself, at once (the hop to a writer task cost
about 0.1 ms of a 4 KiB handoff's 1.5 ms on the dev VM); otherwise one writer task sends the
queued answers. A write must never be cancelled halfway: abandoning a call cancels its task
unless that task is writing its answer; losing the stream cancels every call still running. A stream holds at most
:data:`MAX_CALLS_IN_FLIGHT` calls and as many unsent answers, so a runaway client meets
``RESOURCE_EXHAUSTED`` or back-pressure rather than unbounded lists.

Calls that arrive together in one message (``more``) run as if each came alone; answers ready
together go out in one write to a client that said it reads them (:mod:`kvxfer.batching`):
with 64 pulls in flight, one write instead of 64 trips through grpc.aio's poller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from kvxfer.batching import CALL_BATCHES, Batches, unbatched
from kvxfer.errors import KvxferError
from kvxfer.proto import engine_pb2

from .._log import log_event
from ..edge.rpc import status_of

__all__ = ["MAX_CALLS_IN_FLIGHT", "Handlers", "serve_calls"]

#: Calls one stream may have running at once (one engine's pulls in flight are far fewer).
MAX_CALLS_IN_FLIGHT = 4096

#: A request message's ``call`` field → the coroutine that answers it.
Handlers = Mapping[str, Callable[[Any], Awaitable[Any]]]


def _error(
    call_id: int, code: grpc.StatusCode, details: str, exc: BaseException | None = None
) -> engine_pb2.CallResponse:
    status = engine_pb2.CallStatus(code=code.value[0], details=details)
    if isinstance(exc, KvxferError):
        status.may_still_write = exc.may_still_write
        status.transfer_id = exc.transfer_id[:128]
        status.offer_id = exc.offer_id[:128]
        status.reason = exc.reason
    return engine_pb2.CallResponse(call_id=call_id, error=status)


async def serve_calls(context: Any, handlers: Handlers) -> None:
    """Serve one ``Calls`` stream until the client closes it (then let its calls finish) or
    goes away (then cancel them)."""
    batched = CALL_BATCHES in tuple(context.invocation_metadata() or ())
    await context.send_initial_metadata((CALL_BATCHES,))  # this end reads batched calls
    await _CallsServed(context, handlers, batched).serve()


class _CallsServed:
    """One ``Calls`` stream being served: its running calls and its answers' outbox."""

    def __init__(self, context: Any, handlers: Handlers, batched: bool) -> None:
        self.context, self.handlers = context, handlers
        self.running: dict[int, asyncio.Task[None]] = {}
        self.abandoned: set[asyncio.Task[None]] = set()  # held until they have wound down
        # Answers go through one writer task: cancelling a call (abandon) must never cancel a
        # write in progress, which would leave the stream unable to finish.
        self.outbox: asyncio.Queue[engine_pb2.CallResponse] = asyncio.Queue(MAX_CALLS_IN_FLIGHT)
        self.batches = Batches(self.outbox) if batched else None
        #: Held by whoever writes (the writer task, or a call answering an idle stream).
        self.writing = asyncio.Lock()
        #: Calls writing their own answer: an abandon no longer cancels them.
        self.answering: set[asyncio.Task[None]] = set()

    async def serve(self) -> None:
        writer = asyncio.create_task(self._write_answers(), name="calls-writer")
        try:
            while (batch := await self.context.read()) is not grpc.aio.EOF:
                for request in unbatched(batch):
                    await self._take(request)
                # The calls just started run their first steps (an offer: all of it, and its
                # answer's write) before this task asks gRPC for the next message: asking first
                # kept them waiting ~0.05 ms on the dev VM.
                await asyncio.sleep(0)
            # The client has sent its last request: let the calls still running answer, and the
            # answers go out, before the stream ends (and sends its status).
            while self.running:
                await asyncio.wait(list(self.running.values()))
            await self.outbox.join()
        finally:
            # Lost stream (or daemon stopping): cancel what is left, as for unary calls.
            tasks = list(self.running.values())
            self.running.clear()
            for task in (*tasks, writer):
                task.cancel()
            await asyncio.gather(*tasks, writer, return_exceptions=True)

    async def _take(self, request: engine_pb2.CallRequest) -> None:
        """Start one call (or abandon one), or answer why it cannot run."""
        running, call_id, kind = self.running, request.call_id, request.WhichOneof("call")
        if kind == "abandon":
            task = running.pop(call_id, None)
            if task is not None and task not in self.answering:
                task.cancel()
                self.abandoned.add(task)
                task.add_done_callback(self.abandoned.discard)
        elif kind is None or kind not in self.handlers:
            await self.outbox.put(_error(call_id, grpc.StatusCode.INVALID_ARGUMENT, f"call {call_id} names no call"))
        elif call_id in running:
            detail = f"call id {call_id} is already running"
            await self.outbox.put(_error(call_id, grpc.StatusCode.INVALID_ARGUMENT, detail))
        elif len(running) >= MAX_CALLS_IN_FLIGHT:
            detail = f"more than {MAX_CALLS_IN_FLIGHT} calls running on one stream"
            await self.outbox.put(_error(call_id, grpc.StatusCode.RESOURCE_EXHAUSTED, detail))
        else:
            running[call_id] = asyncio.create_task(self._run(call_id, kind, getattr(request, kind)))

    async def _run(self, call_id: int, kind: str, request: Any) -> None:
        try:
            result = await self.handlers[kind](request)
            response = engine_pb2.CallResponse(call_id=call_id, **{kind: result})
        except asyncio.CancelledError:
            response = _error(call_id, grpc.StatusCode.CANCELLED, f"call {call_id} was cancelled")
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            response = _error(call_id, *status_of(kind.capitalize(), exc), exc)
        task = asyncio.current_task()
        if self.running.get(call_id) is not task:
            return  # abandoned, or the stream is closing: nobody waits for this answer
        # Still listed while queueing or writing: the stream must not end first.
        if self.writing.locked() or not self.outbox.empty() or task is None:
            await self.outbox.put(response)
        else:
            await self._answer(task, response)
        if self.running.get(call_id) is task:
            del self.running[call_id]

    async def _answer(self, task: asyncio.Task[None], response: engine_pb2.CallResponse) -> None:
        """Write this call's answer from its own task (the stream is idle)."""
        self.answering.add(task)
        try:
            async with self.writing:
                await self._write(response)
        finally:
            self.answering.discard(task)

    async def _write_answers(self) -> None:
        """Write the answers as they come: those ready together in one write where the client
        reads them so."""
        outbox, batches = self.outbox, self.batches
        while True:
            response = await (outbox.get() if batches is None else batches.next())
            try:
                async with self.writing:
                    await self._write(response)
            finally:
                for _ in unbatched(response):
                    outbox.task_done()

    async def _write(self, response: engine_pb2.CallResponse) -> None:
        try:
            await self.context.write(response)
        except Exception as exc:  # noqa: BLE001 - the stream is gone; the reader ends it
            log_event("calls.write_failed", logging.DEBUG, call_id=response.call_id, detail=repr(exc))
