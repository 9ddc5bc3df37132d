# SPDX-License-Identifier: AGPL-3.0-only
"""Python stubs of the cluster's gRPC services, generated from `proto/` at test time with
grpcio-tools (protoc as a library): an independent gRPC implementation (gRPC C-core) and
an independent protobuf compiler calling the roles' listeners."""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
_OUT: Path | None = None


def load():
    """(cluster_pb2, cluster_pb2_grpc, iam_pb2, iam_pb2_grpc, sandbox_pb2), generated once."""
    global _OUT
    from grpc_tools import protoc

    if _OUT is None:
        out = Path(tempfile.mkdtemp(prefix="dsec-grpc-stubs-"))
        files = [str(PROTO / "dsec/v1" / f) for f in ("sandbox.proto", "cluster.proto", "iam.proto")]
        rc = protoc.main(["protoc", f"-I{PROTO}", f"--python_out={out}", f"--grpc_python_out={out}", *files])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) on {files}")
        sys.path.insert(0, str(out))
        _OUT = out
    names = ["dsec.v1.cluster_pb2", "dsec.v1.cluster_pb2_grpc", "dsec.v1.iam_pb2", "dsec.v1.iam_pb2_grpc",
             "dsec.v1.sandbox_pb2"]
    return tuple(importlib.import_module(n) for n in names)
