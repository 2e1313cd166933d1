"""``kv_connector_extra_config``: the connector's settings, checked, completed, and each default
taken logged."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvxfer.defaults import default_socket_path

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

__all__ = ["settings"]

log = logging.getLogger("vllm.kvxfer")


def settings(given: dict[str, Any], role: KVConnectorRole) -> dict[str, Any]:
    """``kv_connector_extra_config`` checked (unknown keys refused: a typo must not silently
    fall back to a default) and completed; every default taken is logged."""
    defaults: dict[str, Any] = {
        "socket": default_socket_path(),
        "lease_s": 60.0,
        "pull_timeout_s": 60.0,
        # How long a step with nothing to compute waits for a transfer to end (see
        # ._worker.WorkerTransfers.wait_for_any); 0: it returns at once.
        "idle_wait_s": 0.01,
        # The decode deployment's tensor-parallel size, when it differs from this engine's: each
        # prefill rank's offer then waits for every decode rank that takes its heads.
        "decode_tp_size": 0,
        # The node's KV tier (see ._tier): load stored prefixes, store finished requests.
        "tier": False,
        "tier_salt": "",
    }
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(
            f"kv_connector_extra_config: unknown key(s) {unknown} for KvxferConnector (known: {sorted(defaults)})"
        )
    for key, value in defaults.items():
        if key not in given:
            log.info("kvxfer (%s): %s not set in kv_connector_extra_config, using %r", role.name, key, value)
    settings = {**defaults, **given}
    for key in ("lease_s", "pull_timeout_s"):
        if not float(settings[key]) > 0:
            raise ValueError(
                f"kv_connector_extra_config: {key} must be a positive number of seconds, got {settings[key]!r}"
            )
    if not 0 <= float(settings["idle_wait_s"]) <= 1:
        raise ValueError(
            f"kv_connector_extra_config: idle_wait_s must be between 0 and 1 second, got {settings['idle_wait_s']!r}"
        )
    return settings
