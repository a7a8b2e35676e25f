#!/usr/bin/env bash
# One benchmark at several commits' library in one device call: which commit moved a figure.
#   here:        bash bench/ab_commits.sh prepare SHA...   (each commit's source folders
#                into .ab/SHA, git-ignored; carry ".ab" with ".whl")
#   the device:  bash bench/ab_commits.sh run MODULE [its arguments]  (a benchmark module
#                that takes --out, e.g. hybridgen.benchmarks.engine_bench)
#   either:      bash bench/ab_commits.sh path SHA  (the PYTHONPATH head a run of SHA takes)
# Each run puts .ab/SHA's five source folders ahead of the installed package on PYTHONPATH
# (hybridgen is a namespace package: the first folder holding a subpackage wins), so every
# commit runs the same command with its own library, daemons and benchmarks (a served run's
# daemons inherit the path). AB_COMMITS="SHA..." runs those trees only, in that order. Prints
# the last 6 lines of each commit's output, and writes $OUT/NAME.json ({commit: its --out}) and
# $OUT/NAME.log (each commit's stderr), NAME $AB_NAME or ab: two files, as a device call brings
# back only a few.
set -o pipefail
tree_path() {  # the five source folders of .ab/$1
  local tree=$PWD/.ab/$1
  echo "$tree/shared:$tree/gateway:$tree/cpu_daemon:$tree/gpu_daemon:$tree/bench"
}
case "$1" in
  path) tree_path "$2" ;;
  prepare)
    shift
    rm -rf .ab
    for sha in "$@"; do
      mkdir -p ".ab/$sha"
      git archive "$sha" shared gateway cpu_daemon gpu_daemon bench/hybridgen | tar -x -C ".ab/$sha"
    done
    du -sh .ab ;;
  run)
    module=$2
    shift 2
    source scripts/device_setup.sh
    site=$PYTHONPATH
    name=${AB_NAME:-ab}
    work=$(mktemp -d)
    for sha in ${AB_COMMITS:-$(ls .ab)}; do
      echo "== $sha" >>"$OUT/$name.log"
      PYTHONPATH="$(tree_path "$sha"):$site" HYBRIDGEN_COMMIT=$sha \
        python3 -m "$module" "$@" --out "$work/$sha.json" \
        2>>"$OUT/$name.log" | tail -n 6 | sed "s/^/$sha /"
    done
    python3 - "$work" "$OUT/$name.json" <<'PY'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=1) + "\n")
PY
    ;;
  *) echo "usage: $0 prepare SHA... | run MODULE [arguments] | path SHA" >&2; exit 2 ;;
esac
