"""kvxfer_client: the SDK serving engines use to hand KV-cache blocks between GPUs and nodes.

The engine registers a pool (buffers plus a :class:`Layout`), the prefill side offers blocks
and gets a JSON :class:`Ticket`, the decode side pulls the ticket into its own blocks, and the
prefill side receives an :class:`OfferReleased` event once it may free them.
"""

from kvxfer.defaults import default_socket_path
from kvxfer.errors import (
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    IncompatibleError,
    InternalError,
    InvalidRequestError,
    KvxferError,
    NotFoundError,
    OfferExpiredError,
    OfferTakenError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from kvxfer.geometry import KvGeometry
from kvxfer.host_memory import HostBuffer
from kvxfer.layout import Layout, ModelInfo, Region
from kvxfer.ticket import Ticket
from kvxfer.version import __version__

from ._blocking import KvxferClient
from ._client import AsyncKvxferClient
from ._events import OfferReleased, ReleaseReason, TransferFailed
from ._results import CancelResult, Pool, PoolRef, PullResult, PushResult
from ._tensor_layout import layout_from_tensors

__all__ = [
    "AlreadyExistsError",
    "AsyncKvxferClient",
    "CancelResult",
    "CancelledError",
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
    "ModelInfo",
    "NotFoundError",
    "OfferExpiredError",
    "OfferReleased",
    "OfferTakenError",
    "PermissionDeniedError",
    "Pool",
    "PoolRef",
    "PullResult",
    "PushResult",
    "Region",
    "ReleaseReason",
    "ResourceExhaustedError",
    "Ticket",
    "TransferFailed",
    "UnavailableError",
    "__version__",
    "default_socket_path",
    "layout_from_tensors",
]
