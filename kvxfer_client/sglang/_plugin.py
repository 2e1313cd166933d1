"""The registration that makes ``--disaggregation-transfer-backend kvxfer`` an SGLang choice.

SGLang picks its prefill/decode transfer backend from a closed set: the ``choices`` of the
flag, the ``TransferBackend`` enum and ``get_kv_class``. It has no setting that loads a
backend by module path, but it runs *general plugins* early in every process it starts (the
launcher before it parses flags, each scheduler, the tokenizer): the callables installed
under the entry point group ``sglang.srt.plugins``, whose hooks it then applies with its own
``HookRegistry``. kvxfer installs :func:`register` there, and it adds kvxfer to all three.

Everything SGLang itself calls ``TransferBackend`` becomes an enum with the same members plus
``KVXFER``; SGLang's hook registry rebinds every module that imported the old one, so its
own comparisons (``== TransferBackend.MOONCAKE``) keep working. The classes SGLang asks
``get_kv_class`` for under ``kvxfer`` are this package's; any other backend goes to SGLang's
own function.

The names used here are SGLang's internals, not an API it promises: :data:`TESTED_SGLANG`
lists the releases this was tested with, and another one is refused with the reason
(``KVXFER_SGLANG_ANY_VERSION=1`` tries it anyway).
"""

from __future__ import annotations

import enum
import logging
import os
from importlib import metadata
from typing import Any

from kvxfer.errors import IncompatibleError

__all__ = ["BACKEND", "TESTED_SGLANG", "check_version", "register"]

logger = logging.getLogger("kvxfer_client.sglang")

#: The flag's value: ``--disaggregation-transfer-backend kvxfer``.
BACKEND = "kvxfer"
#: SGLang releases the backend was tested with (``make sglang-test``).
TESTED_SGLANG = ("0.5.23",)

_UTILS = "sglang.srt.disaggregation.utils"


def check_version(version: str | None = None) -> str:
    """The installed SGLang's version, refused when it is not one of :data:`TESTED_SGLANG`.

    >>> check_version("0.5.23")
    '0.5.23'
    >>> check_version("0.6.0")
    Traceback (most recent call last):
    ...
    kvxfer_client.IncompatibleError: kvxfer's SGLang backend was tested with SGLang 0.5.23, not 0.6.0: ...
    """
    found = version if version is not None else metadata.version("sglang")
    if found in TESTED_SGLANG or os.environ.get("KVXFER_SGLANG_ANY_VERSION") == "1":
        return found
    raise IncompatibleError(
        f"kvxfer's SGLang backend was tested with SGLang {', '.join(TESTED_SGLANG)}, not {found}: "
        f"install sglang=={TESTED_SGLANG[-1]}, or set KVXFER_SGLANG_ANY_VERSION=1 to try this one"
    )


def register() -> None:
    """SGLang's general plugin (entry point ``kvxfer`` in ``sglang.srt.plugins``): add the
    ``kvxfer`` backend. Runs once per process, before SGLang applies its hooks."""
    version = check_version()
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    if not any(member.value == BACKEND for member in utils.TransferBackend):
        members = {member.name: member.value for member in utils.TransferBackend}
        extended = enum.Enum("TransferBackend", {**members, "KVXFER": BACKEND}, module=_UTILS)  # type: ignore[misc]
        HookRegistry.register(f"{_UTILS}.TransferBackend", extended, HookType.REPLACE)
        HookRegistry.register(f"{_UTILS}.get_kv_class", _get_kv_class, HookType.AROUND)
    logger.info("kvxfer: SGLang %s transfer backend %r registered", version, BACKEND)


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """SGLang's ``get_kv_class``, answering for ``kvxfer`` (KV args stay SGLang's own)."""
    if getattr(transfer_backend, "value", None) != BACKEND or class_type.value == "kvargs":
        return original(transfer_backend, class_type)
    from . import _conn

    classes = {
        "manager": _conn.KvxferKVManager,
        "sender": _conn.KvxferKVSender,
        "receiver": _conn.KvxferKVReceiver,
        "bootstrap_server": _conn.KvxferKVBootstrapServer,
    }
    return classes[class_type.value]
