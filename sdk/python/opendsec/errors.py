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


class NotFoundError(DSecError):
    pass


class PreconditionError(DSecError):
    pass


class ResourceExhaustedError(DSecError):
    pass


class UnavailableError(DSecError):
    pass


_BY_CODE = {
    "invalid_argument": InvalidArgumentError,
    "unauthenticated": AuthenticationError,
    "permission_denied": AuthenticationError,
    "not_found": NotFoundError,
    "failed_precondition": PreconditionError,
    "resource_exhausted": ResourceExhaustedError,
    "unavailable": UnavailableError,
}


def from_response(status: int, body: object) -> DSecError:
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        code = body["code"]
        return _BY_CODE.get(code, DSecError)(code, str(body.get("message", "")), status)
    return DSecError("http_error", f"HTTP {status}: {body!r}", status)
