"""The benchmark's baseline: a plain UCXX send between two processes kept alive, so that
``bench.ratio`` can interleave it with handoffs."""

from __future__ import annotations

import pytest

from bench.ucx_baseline import BaselinePair

pytest.importorskip("ucxx")


def test_the_baseline_pair_moves_the_whole_buffer_on_every_send() -> None:
    with BaselinePair(4 << 20, "shm") as pair:
        sent, received = pair.digests()
        assert sent == received  # the warm-up send at start already moved it
        assert all(pair.send() > 0 for _ in range(3))
        assert pair.digests() == (sent, sent)


def test_the_baseline_pair_refuses_an_unknown_memory_kind() -> None:
    with pytest.raises(ValueError, match="memory must be"):
        BaselinePair(1 << 20, "gpu")
