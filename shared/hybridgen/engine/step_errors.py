"""How a request that the engine accepted can still fail: the step it was in failed.

A step that raises (the device ran out of memory, or a bug) fails only the requests of that
step: they end with a status and a message, their KV is freed, and the daemon keeps serving
the others. The status crosses the rings as an ErrorCode and reaches the client as the gRPC
status of the same name.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Why a request ended with an error (the gRPC status of the same name)."""

    INVALID_ARGUMENT = 1
    """The request was refused: a field out of range (its message names the field)."""
    RESOURCE_EXHAUSTED = 2
    """Its step ran out of device memory."""
    INTERNAL = 3
    """Its step failed for another reason (a bug; the GPU daemon's log has the traceback)."""
    DATA_LOSS = 4
    """A ticket of it was corrupted between the daemons (ipc/channels.py: CORRUPT); its KV
    is freed and a retry may succeed."""


class StepFailed(RuntimeError):
    """The step a request was in failed; `code` says how to answer the client."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
