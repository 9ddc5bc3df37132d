# SPDX-License-Identifier: Apache-2.0
"""OpenDsec Python SDK: sandboxes for agents and RL rollouts."""

from .client import DSecClient, DSecRunArgs, ExecResult, Sandbox, SandboxInfo
from .errors import (
    AuthenticationError,
    DSecError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionError,
    ResourceExhaustedError,
    UnavailableError,
)

__all__ = [
    "DSecClient",
    "DSecRunArgs",
    "ExecResult",
    "Sandbox",
    "SandboxInfo",
    "DSecError",
    "AuthenticationError",
    "InvalidArgumentError",
    "NotFoundError",
    "PreconditionError",
    "ResourceExhaustedError",
    "UnavailableError",
]
__version__ = "0.1.0"
