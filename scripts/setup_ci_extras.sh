#!/usr/bin/env bash
# CI (.ci/run): the system programs some tests drive besides the venv: nginx for
# tests/test_nginx.py (replicas behind deploy/nginx/hybridgen.conf). Needs root and apt-get;
# without them it says so and changes nothing, and those tests skip with the reason.
set -euo pipefail
if command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]]; then
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "setup_ci_extras: not root or no apt-get: nginx not installed, tests/test_nginx.py skips" >&2
  exit 0
fi
# The package would start the system's nginx on port 80; only the tests' own nginx should run.
# A policy-rc.d that denies every start is Debian's way to say so; an existing one is kept.
policy=/usr/sbin/policy-rc.d
added=""
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 0755 "$policy" && added=1
fi
trap 'if [[ -n $added ]]; then rm -f "$policy"; fi' EXIT
# A failed install (no mirror reachable) must not stop CI: the nginx tests then skip, saying so.
if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends nginx; }; then
  echo "setup_ci_extras: apt-get could not install nginx: tests/test_nginx.py skips" >&2
fi
