"""The one exception hierarchy of kvxfer, and its mapping to gRPC status codes.

::

    KvxferError                      (every error kvxfer raises on purpose)
    ├── InvalidRequestError          INVALID_ARGUMENT (also a ValueError)
    ├── NotFoundError                NOT_FOUND (also a LookupError)
    │   └── OfferExpiredError        NOT_FOUND, reason "offer-expired"
    ├── AlreadyExistsError           ALREADY_EXISTS
    ├── PermissionDeniedError        PERMISSION_DENIED
    ├── IncompatibleError            FAILED_PRECONDITION
    │   └── OfferTakenError          FAILED_PRECONDITION, reason "offer-taken"
    ├── ResourceExhaustedError       RESOURCE_EXHAUSTED
    ├── DeadlineExceededError        DEADLINE_EXCEEDED (also a TimeoutError)
    ├── UnavailableError             UNAVAILABLE (also a ConnectionError)
    ├── CancelledError               CANCELLED
    ├── DataLossError                DATA_LOSS
    └── InternalError                INTERNAL

Every error a daemon reports reaches the SDK as the same class it was raised as: the daemon
aborts the RPC with ``error.grpc_code``, the message and the error's typed fields
(``may_still_write``, ``transfer_id``, ``offer_id``, and ``reason`` for a subclass that a
code alone does not name) as trailing metadata, and the SDK turns the status back into the
class with :func:`error_from_rpc`. This module is the only place
that pairs classes with codes and fields with metadata keys.

>>> err = error_from_status(grpc.StatusCode.NOT_FOUND, "no offer 'x'", offer_id="x")
>>> err
kvxfer_client.NotFoundError("no offer 'x'")
>>> isinstance(err, NotFoundError), err.offer_id, err.may_still_write
(True, 'x', False)
"""

from __future__ import annotations

import grpc

__all__ = [
    "AlreadyExistsError",
    "CancelledError",
    "DataLossError",
    "DeadlineExceededError",
    "IncompatibleError",
    "InternalError",
    "InvalidRequestError",
    "KvxferError",
    "NotFoundError",
    "OfferExpiredError",
    "OfferTakenError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnavailableError",
    "error_from_rpc",
    "error_from_status",
    "metadata_of",
    "status_code",
]

#: Trailing-metadata keys of an error's typed fields.
_KEY_MAY_STILL_WRITE = "kvxfer-may-still-write"
_KEY_TRANSFER_ID = "kvxfer-transfer-id"
_KEY_OFFER_ID = "kvxfer-offer-id"
_KEY_REASON = "kvxfer-reason"


class KvxferError(Exception):
    """Base class of every error kvxfer raises on purpose.

    ``may_still_write`` is True on a failed pull whose receives UCX did not confirm cancelled:
    the engine must keep those destination blocks out of use (quarantine) until it
    deregisters the pool, instead of handing them to another request. ``transfer_id`` and
    ``offer_id`` name the transfer and offer the error concerns ("" where none).
    """

    grpc_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    #: Names a subclass its status code alone does not (carried beside the code).
    reason: str = ""

    def __init__(
        self, message: str = "", *, transfer_id: str = "", offer_id: str = "", may_still_write: bool = False
    ) -> None:
        super().__init__(message)
        self.transfer_id = transfer_id
        self.offer_id = offer_id
        self.may_still_write = may_still_write

    def __repr__(self) -> str:
        return f"kvxfer_client.{type(self).__name__}({str(self)!r})"


class InvalidRequestError(KvxferError, ValueError):
    """The request itself is wrong: bad block ids, sizes, layout, ticket or argument."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(KvxferError, LookupError):
    """The pool, offer, session or transfer named does not exist (any more)."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class OfferExpiredError(NotFoundError):
    """The offer's lease ended before anyone pulled it. Operators read it as a capacity signal
    (the decode side took longer than ``lease_s`` to start the pull), not a transport failure:
    raise the lease, add decode capacity, or keep waiting offers alive (``extend_lease``)."""

    reason = "offer-expired"


class AlreadyExistsError(KvxferError):
    """An object with this id exists already (e.g. a transfer id in use)."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(KvxferError):
    """Wrong or missing offer token, or a caller not allowed to do this."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class IncompatibleError(KvxferError):
    """The two ends cannot work together: layout fingerprint, protocol version, state."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class OfferTakenError(IncompatibleError):
    """Another transfer is pulling the offer, or has pulled it (an offer is pulled once per
    reader): the loser of two concurrent pulls of one ticket gets this, whichever finished."""

    reason = "offer-taken"


class ResourceExhaustedError(KvxferError):
    """A limit was reached (too many offers, staging memory, message size)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(KvxferError, TimeoutError):
    """An operation did not finish before its deadline."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(KvxferError, ConnectionError):
    """A daemon or peer cannot be reached, or is draining."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class CancelledError(KvxferError):
    """The transfer or offer was cancelled."""

    grpc_code = grpc.StatusCode.CANCELLED


class DataLossError(KvxferError):
    """Blocks arrived with other bytes than were offered: changed at the source after the
    offer (a block reused too early) or corrupted on the way. The destination is not filled."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class InternalError(KvxferError):
    """A bug or an unexpected failure inside kvxfer."""

    grpc_code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[KvxferError]] = {
    cls.grpc_code: cls
    for cls in (
        InvalidRequestError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        IncompatibleError,
        ResourceExhaustedError,
        DeadlineExceededError,
        UnavailableError,
        CancelledError,
        DataLossError,
        InternalError,
    )
}
_BY_REASON: dict[str, type[KvxferError]] = {cls.reason: cls for cls in (OfferExpiredError, OfferTakenError)}
_BY_CODE[grpc.StatusCode.OUT_OF_RANGE] = InvalidRequestError
_BY_CODE[grpc.StatusCode.ABORTED] = CancelledError
_BY_CODE[grpc.StatusCode.UNIMPLEMENTED] = IncompatibleError


def error_from_status(
    code: grpc.StatusCode | None,
    details: str | None,
    *,
    transfer_id: str = "",
    offer_id: str = "",
    may_still_write: bool = False,
    reason: str = "",
) -> KvxferError:
    """Return the kvxfer error for a gRPC status code, its details and typed fields.

    >>> error_from_status(grpc.StatusCode.NOT_FOUND, "lease ended", reason="offer-expired")
    kvxfer_client.OfferExpiredError('lease ended')
    """
    cls = _BY_CODE.get(code, KvxferError) if code is not None else KvxferError
    special = _BY_REASON.get(reason)
    if special is not None and issubclass(special, cls):
        cls = special
    message = details or (code.name if code is not None else "unknown error")
    return cls(message, transfer_id=transfer_id, offer_id=offer_id, may_still_write=may_still_write)


def metadata_of(err: KvxferError) -> tuple[tuple[str, str], ...]:
    """An error's typed fields as trailing metadata (what :func:`error_from_rpc` reads)."""
    pairs = []
    if err.may_still_write:
        pairs.append((_KEY_MAY_STILL_WRITE, "1"))
    if err.transfer_id:
        pairs.append((_KEY_TRANSFER_ID, err.transfer_id[:128]))
    if err.offer_id:
        pairs.append((_KEY_OFFER_ID, err.offer_id[:128]))
    if err.reason:
        pairs.append((_KEY_REASON, err.reason))
    return tuple(pairs)


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode | None:
    """The gRPC status code numbered ``number`` (as carried in a ``CallStatus``), or None.

    >>> status_code(5)
    <StatusCode.NOT_FOUND: (5, 'not found')>
    """
    return _BY_NUMBER.get(number)


def error_from_rpc(exc: grpc.RpcError) -> KvxferError:
    """Turn a failed RPC (``grpc.aio.AioRpcError`` or a sync ``grpc.RpcError``) into an error."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    fields = {k: v for k, v in (trailing or ()) if isinstance(v, str)}
    return error_from_status(
        code,
        details,
        transfer_id=fields.get(_KEY_TRANSFER_ID, ""),
        offer_id=fields.get(_KEY_OFFER_ID, ""),
        may_still_write=fields.get(_KEY_MAY_STILL_WRITE) == "1",
        reason=fields.get(_KEY_REASON, ""),
    )


def _public(*classes: type[KvxferError]) -> None:
    """Tracebacks and reprs name the errors where users import them from."""
    for cls in classes:
        cls.__module__ = "kvxfer_client"


_public(KvxferError, *set(_BY_CODE.values()))
