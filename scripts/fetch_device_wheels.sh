#!/usr/bin/env bash
# Fetch the cp312 manylinux wheels that the H200 benchmark machine lacks into .whl/ (git-ignored).
# The device image has torch 2.11, transformers, triton, grpcio 1.84.0 and protobuf; these are
# the packages it does not have, at versions that match its grpcio (accelerate and psutil:
# the B4 baseline; gguf, starlette and uvicorn: GGUF models and the OpenAI HTTP API).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_5_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  structlog==26.1.0 posix-ipc==1.3.2 lz4==4.4.4 \
  grpcio-reflection==1.84.0 grpcio-health-checking==1.84.0 \
  matplotlib==3.10.9 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 \
  pyparsing==3.3.3 pillow==13.0.0 python-dateutil==4.0.0 tzdata==2026.6 \
  accelerate==1.15.0 psutil==7.1.3 \
  gguf==0.19.0 starlette==1.10.0 uvicorn==0.54.0
ls -1 .whl
