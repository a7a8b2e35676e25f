"""The committed gRPC stubs are exactly what scripts/gen_proto.sh generates from the proto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUBS = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")
# The benchmark machine runs grpcio 1.84.0; stubs from a newer grpcio-tools refuse to import
# there, so the generator is pinned (pyproject.toml).
PINNED_GRPC_TOOLS = "1.84.0"


def test_stubs_match_the_proto(tmp_path: Path) -> None:
    from importlib.metadata import version

    if version("grpcio-tools") != PINNED_GRPC_TOOLS:
        pytest.fail(
            f"grpcio-tools {version('grpcio-tools')} installed; stubs need the pinned "
            f"{PINNED_GRPC_TOOLS}"
        )
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
    )
    for name in STUBS:
        committed = (ROOT / "shared" / "hybridgen" / "v1" / name).read_bytes()
        assert (tmp_path / name).read_bytes() == committed, (
            f"shared/hybridgen/v1/{name} is stale: run scripts/gen_proto.sh and commit the result"
        )


def test_stubs_import_under_the_package_mapping() -> None:
    from hybridgen.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.name == "hybridgen/v1/generation.proto"
    assert generation_pb2_grpc.GRPC_GENERATED_VERSION == PINNED_GRPC_TOOLS
    service = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    assert service.full_name == "hybridgen.v1.GenerationService"
    assert set(service.methods_by_name) == {
        "Generate",
        "StreamGenerate",
        "Tokenize",
        "GetModelInfo",
    }
