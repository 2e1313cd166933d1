"""The address probe's child process (see :mod:`.ucx_address`): run by path, it imports UCXX
and the standard library only.

Protocol on stdin/stdout: the parent writes ``>IB`` (address length, error-handling flag) and
the address; the child makes an endpoint from it, aborts it, and answers ``1``, whether UCX
made the endpoint or refused it with an error. If UCX aborts the process instead, the parent
reads end-of-file. The child says ``R`` once its UCX worker exists, and exits at end of input.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys


def main() -> None:
    # Answers go out on a private copy of stdout: UCX prints its own messages (an assertion
    # among them) to fd 1, which from here on is stderr.
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    os.environ["UCXPY_PROGRESS_MODE"] = "thread"  # no event loop here drives the worker
    import ucxx
    from ucxx._lib.libucxx import UCXAddress

    async def run() -> None:
        stdin = sys.stdin.buffer
        ucxx.get_worker_address()  # the context and worker exist before we say ready
        answers.write(b"R")
        while True:
            header = stdin.read(5)
            if len(header) < 5:
                return
            size, error_handling = struct.unpack(">IB", header)
            address = stdin.read(size)
            try:
                ep = await ucxx.create_endpoint_from_worker_address(
                    UCXAddress.create_from_buffer(address), endpoint_error_handling=bool(error_handling)
                )
                ep.abort()
            except Exception:  # noqa: BLE001 - UCX said no without crashing: that is an answer
                pass
            answers.write(b"1")

    asyncio.run(run())
    os._exit(0)  # skip UCXX's teardown at interpreter exit (nothing left to flush)


if __name__ == "__main__":
    main()
