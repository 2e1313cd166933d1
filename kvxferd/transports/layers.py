"""Layer-wise streaming: which layers of an offer move when (engine.proto, LayersReady).

An offer made with ``layers = L`` is written by its engine one layer after the other while a
pull may already run. Its stream is then planned per layer (``plan.build_layered_plan``: no
chunk spans two layers), and :func:`layer_batches` says which layers to move next: those
written and not moved yet, once they add up to ``batch_bytes`` or include the last layer, so
that short requests do not pay a message per layer. The transfer commits only after the last
batch has landed, as any other.

>>> class OneByOne:   # an offer whose engine writes each layer just as it is waited for
...     layers = 4
...     async def wait_ready(self, layers: int) -> int:
...         return min(layers, self.layers)
>>> async def demo() -> list[tuple[int, int]]:
...     return [b async for b in layer_batches(OneByOne(), [10, 10, 10, 10], batch_bytes=20)]
>>> asyncio.run(demo())
[(0, 2), (2, 4)]
>>> layer_sizes([4, 4, 8, 8], num_blocks=3, layers=2)   # K, V of layer 0, then of layer 1
[24, 48]
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

__all__ = ["LayerProgress", "LayeredOffer", "layer_batches", "layer_sizes", "send_by_layer"]


class LayeredOffer(Protocol):
    """What :func:`layer_batches` needs of an offer (``kvxferd._offers.Offer``)."""

    layers: int

    async def wait_ready(self, layers: int) -> int: ...


def layer_sizes(region_bytes: Sequence[int], num_blocks: int, layers: int) -> list[int]:
    """Bytes of each layer of a transfer of ``num_blocks`` blocks: the regions' bytes per block
    fall into ``layers`` equal groups in order."""
    per = len(region_bytes) // layers
    return [num_blocks * sum(region_bytes[g * per : (g + 1) * per]) for g in range(layers)]


async def layer_batches(
    offer: LayeredOffer, sizes: Sequence[int], batch_bytes: float
) -> AsyncIterator[tuple[int, int]]:
    """``(first layer, end layer)`` ranges to move, in order, each once it is written and at
    least ``batch_bytes`` long (or ends with the last layer); ``sizes``: each layer's bytes."""
    total_layers = len(sizes)
    moved = 0
    while moved < total_layers:
        ready = await offer.wait_ready(moved + 1)
        while ready < total_layers and sum(sizes[moved:ready]) < batch_bytes:
            ready = await offer.wait_ready(ready + 1)
        yield moved, ready
        moved = ready


async def send_by_layer(
    offer: LayeredOffer,
    sizes: Sequence[int],
    batch_bytes: float,
    send: Callable[[int, int], Awaitable[None]],
    overlap: bool,
) -> None:
    """Send each batch of written layers with ``send(first, end)``. With ``overlap`` (sends
    that share no staging), a batch goes out while the ones before it are still in flight:
    awaiting each in turn drained the pipeline between batches, which a request whose transfer
    outlasts its compute paid once per batch (``bench.ttft --prefill-tokens-per-s 100000``)."""
    flying: set[asyncio.Task[None]] = set()
    try:
        async for first, end in layer_batches(offer, sizes, batch_bytes):
            if not overlap:
                await send(first, end)
                continue
            for task in [t for t in flying if t.done()]:
                flying.discard(task)
                task.result()  # a failed batch fails the transfer now
            flying.add(asyncio.ensure_future(send(first, end)))
        await asyncio.gather(*flying)
    finally:
        for task in flying:
            task.cancel()
        if flying:
            await asyncio.wait(flying)


class LayerProgress:
    """Which layers of a layer-wise stream have landed, from its chunks, which land in any
    order: ``emit(n)`` each time the first ``n`` layers are complete (``starts``: where each
    layer's chunks start, then the end).

    >>> seen: list[int] = []
    >>> progress = LayerProgress([0, 2, 3, 5], seen.append)
    >>> for chunk in (1, 2, 0, 4, 3):
    ...     progress.chunk_landed(chunk)
    >>> seen
    [2, 3]
    """

    def __init__(self, starts: Sequence[int], emit: Callable[[int], None]) -> None:
        self._starts = list(starts)
        self._left = [starts[g + 1] - starts[g] for g in range(len(starts) - 1)]
        self._emit = emit
        self.landed = 0

    def chunk_landed(self, index: int) -> None:
        self._left[bisect.bisect_right(self._starts, index) - 1] -= 1
        complete = self.landed
        while complete < len(self._left) and self._left[complete] == 0:
            complete += 1
        if complete > self.landed:
            self.landed = complete
            self._emit(complete)
