"""kvxfer as a vLLM KV connector.

Load it by module path::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer_client.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvxfer/kvxferd.sock"}}'

``KvxferConnector`` is imported on first use: it subclasses vLLM's connector base, so only
then is vLLM needed (``pip install kvxfer[vllm]``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxferConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvxferConnector":
        from ._connector import KvxferConnector

        return KvxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
