#!/usr/bin/env bash
# Source this on the H200 machine (no network there): installs the carried wheels (.whl/, from
# scripts/fetch_device_wheels.sh) and this package into /tmp/site, and puts it on PYTHONPATH.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
  --target /tmp/site . >/dev/null
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
set +e
