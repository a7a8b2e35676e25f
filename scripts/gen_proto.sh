#!/usr/bin/env bash
# Regenerate the committed gRPC stubs in shared/hybridgen/v1 (the package hybridgen.v1).
#
# protoc writes hybridgen/v1/generation_pb2*.py under its output folder (the proto's path);
# the library's source folder is shared/, so they land in shared/hybridgen/v1, the path their
# import name says. The stubs import each other as `from hybridgen.v1 import generation_pb2`.
# grpcio-tools is pinned to 1.84.0 (pyproject.toml) so that the stubs import under the
# benchmark machine's grpcio 1.84.0; tests/test_proto_stubs.py fails on any difference.
#
# Usage: scripts/gen_proto.sh [dest_dir]   (default: shared/hybridgen/v1; PYTHON picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
DEST="${1:-shared/hybridgen/v1}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PYTHON" -m grpc_tools.protoc -Iproto \
    --python_out="$TMP" --pyi_out="$TMP" --grpc_python_out="$TMP" \
    proto/hybridgen/v1/generation.proto
mkdir -p "$DEST"
cp "$TMP"/hybridgen/v1/generation_pb2.py "$TMP"/hybridgen/v1/generation_pb2.pyi \
    "$TMP"/hybridgen/v1/generation_pb2_grpc.py "$DEST"/
