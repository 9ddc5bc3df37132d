# SPDX-License-Identifier: Apache-2.0
"""Errors raised for API failures; each carries the server's code, message and status."""

from __future__ import annotations


class DSecError(Exception):
    """An API call failed. `code` is machine-readable, `message` says what to fix."""

    def __init__(self, code: str, message: str, status: int = 0):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


class InvalidArgumentError(DSecError):
    pass


class AuthenticationError(DSecError):
    pass


class PermissionDeniedError(AuthenticationError):
    """No permission (e.g. a file inside the sandbox). A subclass of AuthenticationError,
    which ``permission_denied`` was reported as before."""


class NotFoundError(DSecError):
    pass


class AlreadyExistsError(DSecError):
    pass


class PreconditionError(DSecError):
    pass


class ResourceExhaustedError(DSecError):
    pass


class UnavailableError(DSecError):
    pass


class DeadlineExceededError(DSecError):
    """Something did not finish in time (e.g. a function call past its timeout)."""


class FunctionError(DSecError):
    """A called function ran and exited non-zero; ``result`` is its ``FunctionResult``
    (exit code, stderr, output)."""

    def __init__(self, result: object):
        r = result
        super().__init__("function_failed",
                         f"function {getattr(r, 'function', '?')!r} exited with {getattr(r, 'exit_code', '?')}: "
                         f"{str(getattr(r, 'stderr', '')).strip()[-500:]}", 200)
        self.result = result


_BY_CODE = {
    "invalid_argument": InvalidArgumentError,
    "unauthenticated": AuthenticationError,
    "permission_denied": PermissionDeniedError,
    "not_found": NotFoundError,
    "already_exists": AlreadyExistsError,
    "failed_precondition": PreconditionError,
    "resource_exhausted": ResourceExhaustedError,
    "unavailable": UnavailableError,
    "deadline_exceeded": DeadlineExceededError,
}


# The HTTP status the server uses for each code (for errors that arrive inside a stream).
_STATUS = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "already_exists": 409,
    "failed_precondition": 409,
    "resource_exhausted": 429,
    "internal": 500,
    "unimplemented": 501,
    "unavailable": 503,
    "deadline_exceeded": 504,
}


def from_response(status: int, body: object) -> DSecError:
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        code = body["code"]
        return _BY_CODE.get(code, DSecError)(code, str(body.get("message", "")), status)
    return DSecError("http_error", f"HTTP {status}: {body!r}", status)


def from_event(event: dict) -> DSecError:
    """The error for an ``{"type": "error", "code", "message"}`` event of an NDJSON stream."""
    code = str(event.get("code") or "internal")
    return _BY_CODE.get(code, DSecError)(code, str(event.get("message", "")), _STATUS.get(code, 0))
