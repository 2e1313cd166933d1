"""Disaggregated prefill/decode of a real transformer gives the same tokens as one process.

A prefill engine process runs the prompt and offers its paged KV through kvxfer; a decode
engine process (same daemon: local path; other daemon: UCX path) pulls it into different block
ids, rebuilds the model's cache from its own pool and decodes greedily. The tokens must equal a
single process's. Flipping bytes of one block before the pull must change them, which shows the
comparison can fail.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from examples.disagg_llm import __main__ as example


def _example() -> ModuleType:
    """The example's driver, imported when a test here runs: it imports torch, which took
    ~18 s of every suite's collection on a loaded 2-core machine."""
    return importlib.import_module("examples.disagg_llm.__main__")


def _model() -> ModuleType:
    return importlib.import_module("examples.disagg_llm.model")


MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engines() -> Iterator[example.Engines]:
    # Layer-wise offers stream layer by layer however small (only test_layer_wise_* make them);
    # every byte of every offer is checksummed (the requests here are small).
    streamed = ("--layerwise-min-bytes", "1", "--layerwise-batch-bytes", "1")
    with _example().engines(*streamed, "--integrity", "full") as e:
        yield e


@pytest.fixture(scope="module")
def reference_model() -> Any:
    model, _ = _model().build_model()
    return model


def decoder(engines: example.Engines, path: str) -> Any:
    return engines.decode_local if path == "local" else engines.decode_remote


@pytest.mark.parametrize("path", ["local", "remote"])
@pytest.mark.parametrize("length", [5, 16, 37, 64])
def test_decode_from_pulled_kv_generates_the_single_process_tokens(
    engines: example.Engines, reference_model: Any, path: str, length: int
) -> None:
    prompt = _model().prompt_tokens(100 + length, length)
    expected = _model().generate(reference_model, prompt, MAX_TOKENS)
    got = _example().handoff(engines.prefill, decoder(engines, path), f"same-{path}-{length}", prompt, MAX_TOKENS)
    assert got["ok"], got
    assert got["tokens"] == expected
    assert got["release_reason"] == "pulled"
    # The decode engine used its own block ids, not the prefill engine's.
    assert got["block_ids"] != got["prefill_block_ids"]


@pytest.mark.parametrize("path", ["local", "remote"])
@pytest.mark.parametrize("length", [5, 37, 100])
def test_layer_wise_pushed_kv_decodes_to_the_single_process_tokens(
    engines: example.Engines, reference_model: Any, path: str, length: int
) -> None:
    """The decode engine expects the transfer; the prefill engine pushes its blocks before the
    model runs, stores each layer's KV as the layer finishes and says so: the layers move while
    the next ones compute, and decoding from them gives the single process's tokens."""
    prompt = _model().prompt_tokens(500 + length, length)
    expected = _model().generate(reference_model, prompt, MAX_TOKENS)
    got = _example().streamed_handoff(
        engines.prefill, decoder(engines, path), f"stream-{path}-{length}", prompt, MAX_TOKENS
    )
    assert got["ok"], got
    assert (got["mode"], got["release_reason"]) == ("push", "pulled"), got
    assert got["tokens"] == expected


def test_layers_said_written_before_they_are_never_yield_the_right_tokens(
    engines: example.Engines, reference_model: Any
) -> None:
    """Negative control: a prefill engine that says every layer written before running the
    model lets the transfer move stale blocks: either the checksums see the blocks change
    under the transfer (DataLossError) or the decode engine's tokens differ. Which one depends
    on whether the model wrote the blocks before the source was checked."""
    prompt = _model().prompt_tokens(9, 37)
    expected = _model().generate(reference_model, prompt, MAX_TOKENS)
    try:
        got = _example().streamed_handoff(
            engines.prefill, engines.decode_remote, "stream-early", prompt, MAX_TOKENS, True
        )
    except RuntimeError as exc:
        assert "DataLossError" in str(exc), exc
    else:
        assert got["ok"] and got["tokens"] != expected, got


@pytest.mark.parametrize("path", ["local", "remote"])
def test_a_block_flipped_after_its_offer_is_caught_before_decode_instead_of_changing_the_tokens(
    engines: example.Engines, path: str
) -> None:
    """The prefill engine corrupts an offered block (layer 0's K of its last block) before the
    pull: the checksums taken when it was offered catch it where it lands (full mode here), and
    the offering daemon, summing its source again then, names the engine's own write; the pull
    fails with DataLossError, the decode engine generates nothing from it, and the offer ends
    as failed."""
    request_id = f"flip-{path}"
    done = engines.prefill("prefill", request_id=request_id, prompt=_model().prompt_tokens(7, 37))
    engines.prefill("flip", request_id=request_id, block=len(done["block_ids"]) - 1)
    reply = decoder(engines, path).call(
        "decode",
        request_id=request_id,
        kv_transfer_params=done["kv_transfer_params"],
        first_token=done["first_token"],
        max_tokens=MAX_TOKENS,
    )
    assert not reply["ok"] and reply["error"] == "DataLossError", reply
    assert "changed after they were offered" in reply["detail"], reply
    assert engines.prefill("finished")["released"][request_id] == "failed"


def test_a_ticket_with_the_wrong_token_is_reported_as_a_failed_load(engines: example.Engines) -> None:
    done = engines.prefill("prefill", request_id="bad-token", prompt=_model().prompt_tokens(3, 20))
    params = dict(done["kv_transfer_params"])
    ticket = dict(params["kvxfer_ticket"])
    ticket["token"] = "00" * 16
    params["kvxfer_ticket"] = ticket
    reply = engines.decode_remote.call(
        "decode", request_id="bad-token", kv_transfer_params=params, first_token=done["first_token"], max_tokens=2
    )
    assert reply == {"ok": False, "error": "PermissionDeniedError", "detail": reply["detail"]}
    # The offer survived the bad pull: the prefill engine still holds its blocks.
    assert engines.prefill("finished", timeout_s=0.2)["still_held"] == ["bad-token"]
    assert engines.decode_remote(
        "decode",
        request_id="bad-token",
        kv_transfer_params=done["kv_transfer_params"],
        first_token=done["first_token"],
        max_tokens=2,
    )["ok"]
    assert engines.prefill("finished")["released"] == {"bad-token": "pulled"}
    # The same outcomes reached the engines through the connector's callbacks.
    assert engines.decode_remote("callbacks", request_id="bad-token")["callbacks"] == ["load_failed", "load_done"]
    assert engines.prefill("callbacks", request_id="bad-token")["callbacks"] == ["send_done:pulled"]


@pytest.mark.slow
@pytest.mark.parametrize("length", [255, 500])
def test_long_prompts_and_long_generations_match(engines: example.Engines, reference_model: Any, length: int) -> None:
    prompt = _model().prompt_tokens(length, length)
    expected = _model().generate(reference_model, prompt, 64)
    got = _example().handoff(engines.prefill, engines.decode_remote, f"long-{length}", prompt, 64)
    assert got["tokens"] == expected


@pytest.mark.parametrize("length", [16, 37])
def test_a_decode_side_of_other_tp_and_head_order_rebuilds_the_same_cache(
    engines: example.Engines, reference_model: Any, length: int
) -> None:
    """The prefill pool holds all heads tokens-major; the decode engine runs two TP ranks whose
    pools hold one head each, heads-major, on another daemon: each rank pulls its head of the
    one offer (two readers), the cache is rebuilt from both, and the tokens are the same."""
    prompt = _model().prompt_tokens(300 + length, length)
    expected = _model().generate(reference_model, prompt, MAX_TOKENS)
    got = _example().handoff(engines.prefill, engines.decode_tp2, f"tp2-{length}", prompt, MAX_TOKENS, readers=2)
    assert got["ok"], got
    assert got["mappings"] == ["TP 1->2 (heads 0..0), NHD->HND", "TP 1->2 (heads 1..1), NHD->HND"]
    assert got["tokens"] == expected
    assert got["release_reason"] == "pulled"
