"""The pushes of one engine step (layer-wise streams): started with the step, each layer said
written as the forward pass leaves it (after the GPU work queued so far, on a GPU), the rest
once the step's forward pass is over."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import KvxferError

from .._blocking import KvxferClient
from .._results import PushResult

__all__ = ["PUSH_ANSWER_S", "StepPushes", "done", "log_refusal"]

log = logging.getLogger("vllm.kvxfer")

#: How long the end of a step waits for its pushes' answers (started with the step).
PUSH_ANSWER_S = 30.0


@dataclass
class _Pushing:
    """A push this step makes, and how many of its layers were said written."""

    request_id: str
    push: concurrent.futures.Future[PushResult]
    marked: int = 0

    def ready(self) -> PushResult | None:
        """Its answer once it came and was a push (layers may be marked), else None."""
        if not self.push.done() or self.push.exception() is not None:
            return None
        result = self.push.result()
        return result if result.mode == "push" else None


class StepPushes:
    """This step's pushes; ``release_when(request_id, future)`` is told what each pushed
    request waits for before vLLM may free its blocks."""

    def __init__(
        self, client: KvxferClient, release_when: Callable[[str, concurrent.futures.Future[Any]], None]
    ) -> None:
        self.client = client
        self._release_when = release_when
        #: Pool layers (one per KV tensor), by vLLM's layer name.
        self.layers = 0
        self._layer_of: dict[str, int] = {}
        self._pushing: list[_Pushing] = []
        #: On a GPU, marks wait for the layer's kernels on this thread (None: CPU tensors,
        #: written when the layer returns).
        self._marker: concurrent.futures.ThreadPoolExecutor | None = None

    def register(self, layer_names: list[str], on_gpu: bool) -> None:
        self._layer_of = {name: index for index, name in enumerate(layer_names)}
        self.layers = len(layer_names)
        if on_gpu:
            self._marker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvxfer-layer-marks")

    def started(self, request_id: str, push: concurrent.futures.Future[PushResult]) -> None:
        self._pushing.append(_Pushing(request_id, push))

    def layer_saved(self, layer_name: str) -> None:
        """vLLM left an attention layer (``save_kv_layer``): this step's pushes may send it
        and every layer before it. Returns at once."""
        index = self._layer_of.get(layer_name)
        if self._pushing and index is not None:
            self._mark(list(self._pushing), index + 1)

    def step_saved(self) -> None:
        """The forward pass is over (``wait_for_save``): every layer of this step's pushes is
        written. Waits only for the pushes' answers (started with the step); the blocks stay
        with vLLM until each push is released (finished sending)."""
        pushing, self._pushing = self._pushing, []
        for p in pushing:
            try:
                result = p.push.result(PUSH_ANSWER_S)
            except (KvxferError, concurrent.futures.TimeoutError) as exc:
                log.error("kvxfer: request %s was not pushed: %s (its decode side gets nothing)", p.request_id, exc)
                self._release_when(p.request_id, done())
                continue
            self._release_when(p.request_id, self.client.watch_release(result.ticket.offer_id))
            if result.mode != "push":
                # The decode daemon could not take it: nobody will pull this ticket here.
                log.error("kvxfer: request %s was not pushed (%s); withdrawing it", p.request_id, result.mode_reason)
                try:
                    self.client.release(result.ticket.offer_id)
                except KvxferError as exc:  # e.g. already expired: its release event follows
                    log.warning("kvxfer: could not withdraw request %s's offer: %s", p.request_id, exc)
        self._mark(pushing, self.layers)

    def _mark(self, pushing: list[_Pushing], layers: int) -> None:
        """Say ``layers`` layers of these pushes written: at once on CPU tensors (written when
        the layer returned), after the GPU work queued so far on a GPU (a CUDA event)."""
        if self._marker is None:
            self._send_marks(pushing, layers)
            return
        import torch  # only reached with CUDA tensors registered

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        self._marker.submit(_after(event.synchronize, self._send_marks, pushing, layers))

    def _send_marks(self, pushing: list[_Pushing], layers: int) -> None:
        offers = []
        for p in pushing:
            result = p.ready()
            if result is not None and layers > p.marked:
                p.marked = layers
                offers.append(result.ticket.offer_id)
        if offers:
            self.client.start_layers_ready(offers, layers).add_done_callback(log_refusal)

    def close(self) -> None:
        if self._marker is not None:
            self._marker.shutdown(wait=True)


def done() -> concurrent.futures.Future[Any]:
    """A future that is already done (nothing to wait for)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(None)
    return future


def _after(wait: Callable[[], Any], then: Callable[..., None], *args: Any) -> Callable[[], None]:
    def run() -> None:
        wait()
        then(*args)

    return run


def log_refusal(future: concurrent.futures.Future[Any]) -> None:
    """A layer mark or cancel the daemon refused: the push then ends by its lease or its
    receiver's deadline (logged here so the reason is not lost)."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("kvxfer: the daemon refused a layer mark or cancel: %s", future.exception())
