"""The one exception hierarchy of kvxfer, and its mapping to gRPC status codes.

Every error a daemon reports reaches the SDK as the same class it was raised as: the daemon
aborts the RPC with ``error.grpc_code`` and the message, and the SDK turns the status back into
the class with :func:`error_from_status`. This module is the only place that pairs classes
with codes.

>>> err = error_from_status(grpc.StatusCode.NOT_FOUND, "no offer 'x'")
>>> isinstance(err, NotFoundError), str(err)
(True, "no offer 'x'")
"""

from __future__ import annotations

import grpc

__all__ = [
    "MAY_STILL_WRITE",
    "AlreadyExistsError",
    "CancelledError",
    "DeadlineExceededError",
    "IncompatibleError",
    "InternalError",
    "InvalidRequestError",
    "KvxferError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnavailableError",
    "error_from_rpc",
    "error_from_status",
    "status_code",
]


#: Ends the details of a failed pull whose destination UCX may still write (see below).
MAY_STILL_WRITE = " [destination quarantined: UCX may still write it]"


class KvxferError(Exception):
    """Base class of every error kvxfer raises on purpose.

    ``may_still_write`` is True on a failed pull whose receives UCX did not confirm cancelled:
    the engine must keep those destination blocks out of use (quarantine) until it
    deregisters the pool, instead of handing them to another request.
    """

    grpc_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    may_still_write: bool = False


class InvalidRequestError(KvxferError, ValueError):
    """The request itself is wrong: bad block ids, sizes, layout, ticket or argument."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(KvxferError, LookupError):
    """The pool, offer, session or transfer named does not exist (any more)."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(KvxferError):
    """An object with this id exists already (e.g. a transfer id in use)."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(KvxferError):
    """Wrong or missing offer token, or a caller not allowed to do this."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class IncompatibleError(KvxferError):
    """The two ends cannot work together: layout fingerprint, protocol version, state."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


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
        InternalError,
    )
}
_BY_CODE[grpc.StatusCode.OUT_OF_RANGE] = InvalidRequestError
_BY_CODE[grpc.StatusCode.ABORTED] = CancelledError
_BY_CODE[grpc.StatusCode.UNIMPLEMENTED] = IncompatibleError


def error_from_status(code: grpc.StatusCode | None, details: str | None) -> KvxferError:
    """Return the kvxfer error for a gRPC status code and its details."""
    cls = _BY_CODE.get(code, KvxferError) if code is not None else KvxferError
    err = cls(details or (code.name if code is not None else "unknown error"))
    err.may_still_write = bool(details and details.endswith(MAY_STILL_WRITE))
    return err


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
    return error_from_status(code, details)
