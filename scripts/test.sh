#!/usr/bin/env bash
# Lint, type-check and test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
"$py" -m ruff check .
"$py" -m ruff format --check .
"$py" -m mypy shared gpu_daemon cpu_daemon gateway
"$py" -m pytest -q "$@"
