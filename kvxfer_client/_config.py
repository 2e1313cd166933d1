"""The SDK's switches read from the environment (the defaults it shares with the daemon are in
:mod:`kvxfer.defaults`)."""

from __future__ import annotations

import os

__all__ = ["call_stream_enabled", "huge_pages_enabled"]


def call_stream_enabled() -> bool:
    """Whether clients send Offer and Pull on one ``Calls`` stream (the default) rather than as
    unary calls: ``$KVXFER_CALL_STREAM``, one of 1/true/yes/on or 0/false/no/off.

    >>> os.environ["KVXFER_CALL_STREAM"] = "off"; call_stream_enabled()
    False
    >>> del os.environ["KVXFER_CALL_STREAM"]; call_stream_enabled()
    True
    """
    return _flag("KVXFER_CALL_STREAM", True)


def huge_pages_enabled() -> bool:
    """Whether registering CPU tensors as they are also asks the kernel for transparent huge
    pages on them (``madvise(MADV_HUGEPAGE)`` and ``MADV_COLLAPSE``): ``$KVXFER_HUGE_PAGES``,
    on by default. See ``kvxfer_client._host_tensor.advise_huge_pages``.

    >>> os.environ["KVXFER_HUGE_PAGES"] = "0"; huge_pages_enabled()
    False
    >>> del os.environ["KVXFER_HUGE_PAGES"]; huge_pages_enabled()
    True
    """
    return _flag("KVXFER_HUGE_PAGES", True)


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "1" if default else "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1/true/yes/on or 0/false/no/off, not {value!r}")
