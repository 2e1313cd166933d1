"""Turning kvxfer errors into gRPC statuses, for every servicer method.

The status code of each error class is defined once, in ``kvxfer.errors``; this
decorator is the only place the daemon applies it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvxfer.errors import KvxferError, metadata_of

from .._log import log_event

__all__ = ["rpc_method", "status_of"]

F = TypeVar("F", bound=Callable[..., Any])


def status_of(method: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status ``method`` ends with when it raised ``exc`` (logged here, once): a
    :class:`KvxferError`'s own code, INTERNAL for anything else (a bug)."""
    if isinstance(exc, KvxferError):
        log_event("rpc.error", logging.DEBUG, method=method, code=exc.grpc_code.name, detail=str(exc))
        return exc.grpc_code, str(exc)
    log_event("rpc.internal_error", logging.ERROR, exc_info=exc, method=method, detail=repr(exc))
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {exc!r}"


async def _abort(context: grpc.aio.ServicerContext[Any, Any], method: str, exc: BaseException) -> None:
    code, details = status_of(method, exc)
    # The error's typed fields (may_still_write, ids) travel as trailing metadata.
    trailing = metadata_of(exc) if isinstance(exc, KvxferError) else ()
    await context.abort(code, details, trailing_metadata=trailing)


def rpc_method(fn: F) -> F:
    """Wrap a servicer coroutine or async generator so errors become statuses."""
    name = fn.__name__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: Any, request: Any, context: Any) -> Any:
            try:
                async for item in fn(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                await _abort(context, name, exc)

        return stream  # type: ignore[return-value]

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await _abort(context, name, exc)

    return unary  # type: ignore[return-value]
