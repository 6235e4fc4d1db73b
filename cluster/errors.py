"""What can go wrong with a request, as a kind that survives every hop (scheduler, replica actor, Ray,
router) and one exception per kind. The router maps kinds to HTTP statuses in one table
(router/http/errors.py); the offline `LLM` raises the same exception whatever the tensor-parallel size."""

from __future__ import annotations

from enum import Enum


class ErrorKind(str, Enum):
    INVALID_REQUEST = "invalid_request"  # the request can never run as given: the caller must change it
    ENGINE = "engine"  # the engine failed a step holding the request; the replica serves on
    REPLICA_DOWN = "replica_down"  # the replica can no longer run anything (a rank died, a collective hung)
    TIMEOUT = "timeout"  # the request outlasted its time limit
    OVERLOADED = "overloaded"  # the replica's queue is full: try again later


class RaylmError(Exception):
    """A request failed; `kind` says whose move it is."""

    kind: ErrorKind = ErrorKind.ENGINE


class InvalidRequestError(RaylmError, ValueError):
    """A request the engine cannot run as given; the message says what to change, and `field` (when
    one field is at fault) names it, as an OpenAI error's `param` does, and `code` is an OpenAI error
    code where one fits (context_length_exceeded)."""

    kind = ErrorKind.INVALID_REQUEST

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.field, self.code = field, code


class GenerationError(RaylmError, RuntimeError):
    """The engine could not finish a valid request."""

    kind = ErrorKind.ENGINE


class EngineError(GenerationError):
    """The engine failed a step (a kernel error, an out-of-memory); other requests go on."""

    kind = ErrorKind.ENGINE


class ReplicaDownError(GenerationError):
    """The replica is broken and being replaced; the request may be retried."""

    kind = ErrorKind.REPLICA_DOWN


class RequestTimeoutError(GenerationError):
    kind = ErrorKind.TIMEOUT


class OverloadedError(RaylmError):
    kind = ErrorKind.OVERLOADED


_EXCEPTIONS: dict[ErrorKind, type[RaylmError]] = {
    ErrorKind.INVALID_REQUEST: InvalidRequestError,
    ErrorKind.ENGINE: EngineError,
    ErrorKind.REPLICA_DOWN: ReplicaDownError,
    ErrorKind.TIMEOUT: RequestTimeoutError,
    ErrorKind.OVERLOADED: OverloadedError,
}


def error_for(kind: ErrorKind, message: str, field: str | None = None, code: str | None = None) -> RaylmError:
    """The exception a caller gets for a failure of this kind (an invalid request's with its field and
    code)."""
    if ErrorKind(kind) is ErrorKind.INVALID_REQUEST:
        return InvalidRequestError(message, field, code)
    return _EXCEPTIONS[ErrorKind(kind)](message)
