#!/usr/bin/env bash
# Lint, type-check and test: everything, as CI (.ci/run) runs it; with --fast first, only the
# tests not marked slow (minutes on 2 cores). Other arguments go to pytest; the 60 slowest
# tests are listed last, to keep the suite's time in view.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
select=()
if [[ "${1:-}" == "--fast" ]]; then
  shift
  select=(-m "not slow")
fi
"$py" -m ruff check .
"$py" -m ruff format --check .
"$py" -m mypy shared/hybridgen gateway/hybridgen cpu_daemon/hybridgen gpu_daemon/hybridgen bench/hybridgen
"$py" -m pytest -q --durations=60 ${select[@]+"${select[@]}"} "$@"
