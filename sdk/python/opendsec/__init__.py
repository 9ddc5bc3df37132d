# SPDX-License-Identifier: Apache-2.0
"""OpenDsec Python SDK: sandboxes for agents and RL rollouts."""

from .client import (
    CommitResult,
    SnapshotInfo,
    DSecClient,
    DSecRunArgs,
    ExecResult,
    Files,
    Process,
    Sandbox,
    SandboxInfo,
    Session,
    SessionResult,
    Sessions,
    Trajectory,
    Watch,
)
from .errors import (
    AlreadyExistsError,
    AuthenticationError,
    DSecError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    ResourceExhaustedError,
    UnavailableError,
)

__all__ = [
    "CommitResult",
    "SnapshotInfo",
    "DSecClient",
    "DSecRunArgs",
    "ExecResult",
    "Files",
    "Process",
    "Sandbox",
    "SandboxInfo",
    "Session",
    "SessionResult",
    "Sessions",
    "Trajectory",
    "Watch",
    "DSecError",
    "AlreadyExistsError",
    "AuthenticationError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "PreconditionError",
    "ResourceExhaustedError",
    "UnavailableError",
]
__version__ = "0.1.0"
