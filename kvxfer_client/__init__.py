"""kvxfer_client: the SDK serving engines use to hand KV-cache blocks between GPUs and nodes.

The engine registers a pool (buffers plus a :class:`Layout`), the prefill side offers blocks
and gets a JSON :class:`Ticket`, the decode side pulls the ticket into its own blocks, and the
prefill side receives an :class:`OfferReleased` event once it may free them.
"""

from ._blocking import KvxferClient
from ._client import AsyncKvxferClient
from ._config import default_socket_path
from ._connector import ConnectorMetadata, ConnectorScheduler, ConnectorWorker, LoadSpec, SendSpec
from ._errors import (
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    IncompatibleError,
    InternalError,
    InvalidRequestError,
    KvxferError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from ._events import OfferReleased, ReleaseReason, TransferFailed
from ._geometry import KvGeometry
from ._layout import Layout, ModelInfo, Region
from ._memory import HostBuffer
from ._results import CancelResult, Pool, PullResult, PushResult
from ._tensor_layout import layout_from_tensors
from ._ticket import Ticket
from ._version import __version__

__all__ = [
    "AlreadyExistsError",
    "AsyncKvxferClient",
    "CancelResult",
    "CancelledError",
    "ConnectorMetadata",
    "ConnectorScheduler",
    "ConnectorWorker",
    "DataLossError",
    "DeadlineExceededError",
    "HostBuffer",
    "IncompatibleError",
    "InternalError",
    "InvalidRequestError",
    "KvGeometry",
    "KvxferClient",
    "KvxferError",
    "Layout",
    "LoadSpec",
    "ModelInfo",
    "NotFoundError",
    "OfferReleased",
    "PermissionDeniedError",
    "Pool",
    "PullResult",
    "PushResult",
    "Region",
    "ReleaseReason",
    "ResourceExhaustedError",
    "SendSpec",
    "Ticket",
    "TransferFailed",
    "UnavailableError",
    "__version__",
    "default_socket_path",
    "layout_from_tensors",
]
