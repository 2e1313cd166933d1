"""One error hierarchy, one mapping to gRPC codes, and back."""

from __future__ import annotations

import grpc
import pytest

import kvxfer_client as kx
from kvxfer_client._errors import error_from_status

MAPPING = [
    (kx.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (kx.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (kx.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (kx.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (kx.IncompatibleError, grpc.StatusCode.FAILED_PRECONDITION),
    (kx.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (kx.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (kx.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (kx.CancelledError, grpc.StatusCode.CANCELLED),
    (kx.InternalError, grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(("cls", "code"), MAPPING)
def test_each_error_maps_to_one_code_and_back(cls: type[kx.KvxferError], code: grpc.StatusCode) -> None:
    assert cls.grpc_code == code
    err = error_from_status(code, "why")
    assert type(err) is cls
    assert str(err) == "why"
    assert isinstance(err, kx.KvxferError)


def test_unknown_codes_become_the_base_error() -> None:
    err = error_from_status(grpc.StatusCode.DATA_LOSS, "x")
    assert type(err) is kx.KvxferError


def test_errors_are_also_the_matching_builtin() -> None:
    assert issubclass(kx.InvalidRequestError, ValueError)
    assert issubclass(kx.DeadlineExceededError, TimeoutError)
    assert issubclass(kx.UnavailableError, ConnectionError)
    assert issubclass(kx.NotFoundError, LookupError)


def test_a_quarantine_marker_in_the_details_sets_may_still_write() -> None:
    import grpc

    from kvxfer_client._errors import MAY_STILL_WRITE, error_from_status

    assert error_from_status(grpc.StatusCode.UNAVAILABLE, "peer gone" + MAY_STILL_WRITE).may_still_write
    assert not error_from_status(grpc.StatusCode.UNAVAILABLE, "peer gone").may_still_write
