"""One error hierarchy, one mapping to gRPC codes, and back."""

from __future__ import annotations

import grpc
import pytest

import kvxfer_client as kx
from kvxfer.errors import error_from_status

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
    (kx.DataLossError, grpc.StatusCode.DATA_LOSS),
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
    err = error_from_status(grpc.StatusCode.UNAUTHENTICATED, "x")
    assert type(err) is kx.KvxferError


def test_errors_are_also_the_matching_builtin() -> None:
    assert issubclass(kx.InvalidRequestError, ValueError)
    assert issubclass(kx.DeadlineExceededError, TimeoutError)
    assert issubclass(kx.UnavailableError, ConnectionError)
    assert issubclass(kx.NotFoundError, LookupError)


def test_typed_fields_travel_as_trailing_metadata_and_come_back_as_attributes() -> None:
    from kvxfer.errors import error_from_rpc, metadata_of

    sent = kx.UnavailableError("peer gone", transfer_id="t-1", offer_id="off-2", may_still_write=True)

    class Status(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return sent.grpc_code

        def details(self) -> str:
            return str(sent)

        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return metadata_of(sent)

    got = error_from_rpc(Status())
    assert type(got) is kx.UnavailableError and str(got) == "peer gone"
    assert (got.transfer_id, got.offer_id, got.may_still_write) == ("t-1", "off-2", True)
    assert not error_from_rpc(grpc.RpcError()).may_still_write


def test_errors_show_under_the_public_package() -> None:
    assert repr(kx.NotFoundError("no offer")) == "kvxfer_client.NotFoundError('no offer')"
    assert kx.NotFoundError.__module__ == "kvxfer_client"
