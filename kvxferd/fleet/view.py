"""What the CLI and the metrics see of the registry (a frozen copy, taken on the loop)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RegistryView"]


@dataclass(frozen=True)
class RegistryView:
    """The registry as readers outside the loop see it."""

    url: str = ""
    cluster: str = ""
    state: str = "off"
    detail: str = ""
    #: Daemons registered, this one included when it is.
    nodes: int = 0
