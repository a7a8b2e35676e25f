#!/usr/bin/env bash
# Same-run A/B of B5's ring and heartbeat figures between two commits (issue 20: the layout
# move against the commit before it), on the device: `bench/ring_ab.sh OLD_TREE [PAIRS]`
# where OLD_TREE is `git archive OLD | tar -x -C OLD_TREE` inside the repo (so the device tool
# carries it). The current tree is B, installed by scripts/device_setup.sh; each pair runs A
# then B: measure_ring (200,000 tickets, paced 2,000) and measure_jitter (5 s), every run
# pinned to the same two cores (CORES, default 2,3: the producer process inherits it), since
# unpinned runs of one tree spread 2x with where the scheduler put the two processes. Writes
# $OUT/ring_ab.json and prints both medians last.
source scripts/device_setup.sh
set -o pipefail
old=$1
pairs=${2:-5}
cores=${CORES:-2,3}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
  --target /tmp/site_old "$PWD/$old" >/dev/null
one() {  # $1: label, $2: PYTHONPATH
  (cd /tmp && PYTHONPATH=$2 python3 -c "
import json, os
os.sched_setaffinity(0, {$cores})
from hybridgen.benchmarks import ipc_bench
from hybridgen.benchmarks.ipc_bench import measure_jitter, measure_ring
r = measure_ring(200_000, 2000)
h = measure_jitter(5.0)
print(json.dumps({'tree': '$1', 'module': ipc_bench.__file__, 'cores': [$cores],
                  'tickets_per_s': r['tickets_per_s'],
                  'ring_p99_us': r['latency_us']['p99'],
                  'heartbeat_p99_ms': h['lateness_ms']['p99']}))" 2>>"$OUT/ring_ab_stderr.log")
}
for _ in $(seq "$pairs"); do
  one A /tmp/site_old:/tmp/site | grep '^{' >>"$OUT/ring_ab.jsonl"
  one B "$PYTHONPATH" | grep '^{' >>"$OUT/ring_ab.jsonl"
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/ring_ab.jsonl") if line.startswith("{")]
out = {}
for tree in ("A", "B"):
    mine = [r for r in rows if r["tree"] == tree]
    out[tree] = {k: statistics.median(r[k] for r in mine)
                 for k in ("tickets_per_s", "ring_p99_us", "heartbeat_p99_ms")}
    out[tree]["tickets_per_s_runs"] = [round(r["tickets_per_s"]) for r in mine]
json.dump({"runs": rows, "median": out}, open(f"{sys.argv[1]}/ring_ab.json", "w"), indent=1)
for tree, m in out.items():
    print(tree, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in m.items()})
PY
