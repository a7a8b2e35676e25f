"""The whole CUDA test suite in one pytest process, on a GPU machine (issue 16).

FILES are the test files with a test that runs on CUDA when it is there: the kernels' tests
(tests.kernel_helpers.DEVICE), the tests skipped without CUDA, and the CUDA engines and
servers. tests/test_cuda_suite.py fails when a file of that kind is not listed here.

In one process the suite spends most of its time compiling Triton kernels, one after another
(~300 kernel specializations in the kernel files alone). So first WARM_FILES' tests run split
over --shards pytest processes side by side, each compiling what its tests launch into
Triton's on-disk cache; their outcome is not kept. Then every file of FILES runs in one
process, which finds those kernels compiled: that run, its log and its exit code are the
result.

    python3 scripts/cuda_suite.py --log /tmp/gpu_tests.log [--shards 12]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

WARM_FILES = (
    "tests/test_kernels.py",
    "tests/test_kernels_attention.py",
    "tests/test_kernels_prefill.py",
    "tests/test_hot_codec_kernels.py",
    "tests/test_dense_quant.py",
    "tests/test_grouped_experts.py",
    "tests/test_grouped_gemm.py",
    "tests/test_grouped_moe_block.py",
    "tests/test_expert_grouping.py",
    "tests/test_warm_device.py",
    "tests/test_kvcodec.py",
)
"""The files whose tests are small enough to run many at once on one device."""

FILES = (
    *WARM_FILES,
    "tests/test_gpu.py",
    "tests/test_step_faults.py",
    "tests/test_device_checker.py",
    "tests/test_host_layers.py",
    "tests/test_host_split.py",
    "tests/test_deepseek_v2.py",
    "tests/test_dense_offload_bench.py",
)

PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider")


def collect(files: tuple[str, ...]) -> list[str]:
    """The node ids of files' tests."""
    out = subprocess.run(
        [*PYTEST, "--collect-only", *files], capture_output=True, text=True, check=True
    ).stdout
    ids = (line for line in out.splitlines() if not line.startswith(" ") and "::" in line)
    return list(dict.fromkeys(i for i in ids if i.split("::")[0].endswith(".py")))


def shards(ids: list[str], n: int) -> list[list[str]]:
    """ids dealt round-robin into at most n non-empty shards (a file's parametrizations, which
    compile different kernels, spread over all of them)."""
    return [s for s in (ids[i::n] for i in range(n)) if s]


def warm(files: tuple[str, ...], n: int, timeout_s: float, logs: Path) -> float:
    """Runs files' tests in n processes at once, at most timeout_s; returns the seconds taken."""
    start = time.monotonic()
    procs = []
    for i, shard in enumerate(shards(collect(files), n)):
        log = (logs / f"warm_{i}.log").open("w")
        procs.append(subprocess.Popen([*PYTEST, *shard], stdout=log, stderr=subprocess.STDOUT))
    for p in procs:
        try:
            p.wait(timeout=max(0.0, start + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, required=True, help="the one-process run's output")
    ap.add_argument("--shards", type=int, default=12, help="warm-up processes (0: none)")
    ap.add_argument("--warm-timeout", type=float, default=240.0)
    ap.add_argument("--files", nargs="+", default=list(FILES), help="the suite (default FILES)")
    ap.add_argument("--warm-files", nargs="*", default=list(WARM_FILES))
    args = ap.parse_args(argv)
    if args.shards > 0 and args.warm_files:
        took = warm(tuple(args.warm_files), args.shards, args.warm_timeout, args.log.parent)
        print(f"warm-up: {args.shards} processes, {took:.0f} s", flush=True)
    start = time.monotonic()
    with args.log.open("w") as log:
        rc = subprocess.run(
            [*PYTEST, "-rf", "--durations=0", "--durations-min=1", *args.files],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        ).returncode
    print(f"suite: one process, {time.monotonic() - start:.0f} s, exit code {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
