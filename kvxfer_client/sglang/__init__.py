"""kvxfer as SGLang's prefill/decode transfer backend: ``--disaggregation-transfer-backend kvxfer``.

Installing kvxfer installs :func:`register` as an SGLang general plugin (entry point ``kvxfer``
in the group ``sglang.srt.plugins``); SGLang runs it early in each of its processes, and it
adds ``kvxfer`` to the backends SGLang offers (:mod:`._plugin`). Each prefill and decode rank
then talks to the kvxfer daemon of its node (``$KVXFER_SOCKET``): the decode rank registers its
KV pages and expects the request's pages, the prefill rank pushes them, and the daemons move
the bytes (see ``docs/sglang.md``).

:mod:`kvxfer_client.sglang.hicache` is the node's KV tier as SGLang's HiCache storage, which
SGLang loads by module path (``--hicache-storage-backend dynamic``).

The classes SGLang loads (:mod:`._conn`, :mod:`.hicache`) import SGLang; this module does not,
so it can be imported, and its version check run, anywhere.
"""

from ._plugin import BACKEND, TESTED_SGLANG, check_version, register

__all__ = ["BACKEND", "TESTED_SGLANG", "check_version", "register"]
