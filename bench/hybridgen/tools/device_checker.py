"""Check a GPU / CPU-core pairing: bind the cores, measure the links, compare NUMA nodes.

    python -m hybridgen.tools.device_checker --gpu-id 0 --cpu-cores 0-15 [--strict] \\
        [--json PATH]

Binds this process to --cpu-cores, then reports the GPU (name, memory, compute capability),
the pinned-host H2D and D2H PCIe bandwidth, the host memory copy bandwidth on the bound cores
(the figure the placement cost model calls cpu.bandwidth_gbps), and whether the cores sit on
the GPU's NUMA node. A mismatch is a warning, or exit code 1 with --strict; a bad --cpu-cores
or --gpu-id is exit code 2. Without a CUDA GPU the core, NUMA and host figures are still
reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
import torch

from hybridgen.config.engine import ConfigError
from hybridgen.config.file import parse_cpu_list
from hybridgen.runtime import log as hlog
from hybridgen.runtime.affinity import bind, check_cores, format_cores

log = structlog.get_logger()

SYSFS_ROOT = Path("/sys")
"""Where sysfs is mounted; tests point the pure readers at a fake tree instead."""
PCIE_MIB = 256
"""Size of one pinned-host <-> GPU copy: large enough that per-copy latency is negligible."""
HOST_MIB = 512
"""Size of the host copy: far beyond any last-level cache, so it measures DRAM."""
COPIES = 5
"""Timed copies per figure; the median is reported."""

Verdict = Literal["match", "mismatch", "unknown"]


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device and its measured PCIe bandwidth."""

    id: int
    """CUDA device index."""
    name: str
    """Marketing name, as the driver reports it."""
    memory_gib: float
    """Total device memory."""
    compute_capability: str
    """major.minor, e.g. "9.0"."""
    pci_bus_id: str | None
    """domain:bus:device.function as sysfs spells it; None when neither torch nor nvidia-smi
    gave it."""
    h2d_gbs: float
    """Pinned host to device, median of COPIES copies of PCIE_MIB."""
    d2h_gbs: float
    """Device to pinned host, likewise."""


@dataclass(frozen=True)
class DeviceReport:
    """Everything the checker measured; written as-is with --json."""

    cores: list[int]
    """The cores this process was bound to."""
    core_numa_nodes: list[int]
    """NUMA nodes of those cores; empty when sysfs does not say."""
    gpu: GpuInfo | None
    """None without a CUDA GPU."""
    no_gpu_reason: str | None
    """Why there is no GPU section, else None."""
    gpu_numa_node: int | None
    """The GPU's NUMA node; None when unknown (no GPU, numa_node -1 or missing)."""
    numa: Verdict
    """Whether the cores sit on the GPU's node."""
    host_copy_gbs: float
    """Host memory bandwidth on the bound cores (bytes read plus bytes written, as STREAM)."""


def parse_cores(text: str, available: Iterable[int]) -> list[int]:
    """The cores of a list like "0-15" or "0,2,4-7", all of which must be in `available`."""
    try:
        cores = parse_cpu_list(text, key="--cpu-cores")
    except ConfigError as exc:
        raise ConfigError(f"{exc}; this process may use cores {format_cores(available)}") from exc
    return check_cores(cores, "--cpu-cores", available)


def check_gpu_id(gpu_id: int, count: int) -> None:
    if not 0 <= gpu_id < count:
        raise ConfigError(
            f"--gpu-id={gpu_id} is out of range: allowed 0..{count - 1} "
            f"(CUDA sees {count} device{'s' if count != 1 else ''})"
        )


def read_node_cpulists(sysfs_root: Path) -> dict[int, str]:
    """NUMA node -> its cpulist text, from <sysfs_root>/devices/system/node/node*/cpulist."""
    lists = {}
    for path in (sysfs_root / "devices/system/node").glob("node[0-9]*/cpulist"):
        lists[int(path.parent.name.removeprefix("node"))] = path.read_text()
    return lists


def numa_nodes_of_cores(cores: Iterable[int], node_cpulists: Mapping[int, str]) -> list[int]:
    """The NUMA nodes holding `cores`; empty when no node lists any of them."""
    wanted = set(cores)
    return sorted(
        node
        for node, text in node_cpulists.items()
        # memory-only nodes (CXL, HBM) have an empty cpulist
        if text.strip() and wanted & set(parse_cpu_list(text.strip()))
    )


def normalize_pci_id(pci_id: str) -> str:
    """sysfs's spelling: nvidia-smi prints an 8-digit domain in upper case, sysfs 4 in lower."""
    domain, rest = pci_id.strip().lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def read_gpu_numa(pci_id: str, sysfs_root: Path) -> int | None:
    """The NUMA node of the PCI device `pci_id`; None for -1 (no affinity) or no sysfs entry."""
    path = sysfs_root / "bus/pci/devices" / normalize_pci_id(pci_id) / "numa_node"
    try:
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def compare(gpu_node: int | None, core_nodes: list[int]) -> Verdict:
    if gpu_node is None or not core_nodes:
        return "unknown"
    return "match" if core_nodes == [gpu_node] else "mismatch"


def no_gpu_reason() -> str | None:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "torch sees no CUDA device (no driver, or CUDA_VISIBLE_DEVICES hides them)"
    return None


def gpu_pci_id(gpu_id: int) -> str | None:
    props = torch.cuda.get_device_properties(gpu_id)
    domain, bus, device = (getattr(props, f"pci_{p}_id", None) for p in ("domain", "bus", "device"))
    if isinstance(domain, int) and isinstance(bus, int) and isinstance(device, int):
        return f"{domain:04x}:{bus:02x}:{device:02x}.0"
    # Older torch builds lack the PCI fields. nvidia-smi numbers GPUs in PCI order and ignores
    # CUDA_VISIBLE_DEVICES, so this matches the CUDA index only under CUDA_DEVICE_ORDER=PCI_BUS_ID.
    query = ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", f"--id={gpu_id}"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return normalize_pci_id(out.stdout) if out.stdout.strip() else None


def _cuda_copy_gbs(dst: torch.Tensor, src: torch.Tensor) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up: the first copy pays driver and mapping setup
    seconds = []
    for _ in range(COPIES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return src.nbytes / statistics.median(seconds) / 1e9


def probe_gpu(gpu_id: int) -> GpuInfo:
    """Device facts and PCIe bandwidth; call after binding, so pinned pages are node-local."""
    props = torch.cuda.get_device_properties(gpu_id)
    with torch.cuda.device(gpu_id):
        host = torch.empty(PCIE_MIB * 2**20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(PCIE_MIB * 2**20, dtype=torch.uint8, device=f"cuda:{gpu_id}")
        log.info("measuring_pcie", gpu_id=gpu_id, direction="h2d", mib=PCIE_MIB, copies=COPIES)
        h2d = _cuda_copy_gbs(dev, host)
        log.info("measuring_pcie", gpu_id=gpu_id, direction="d2h", mib=PCIE_MIB, copies=COPIES)
        d2h = _cuda_copy_gbs(host, dev)
    return GpuInfo(
        id=gpu_id,
        name=props.name,
        memory_gib=round(props.total_memory / 2**30, 2),
        compute_capability=f"{props.major}.{props.minor}",
        pci_bus_id=gpu_pci_id(gpu_id),
        h2d_gbs=round(h2d, 2),
        d2h_gbs=round(d2h, 2),
    )


def host_copy_gbs() -> float:
    """Copy bandwidth of the bound cores, counting the read and the write, as STREAM does."""
    log.info("measuring_host_copy", mib=HOST_MIB, copies=COPIES, threads=torch.get_num_threads())
    src = torch.ones(HOST_MIB * 2**20 // 4, dtype=torch.float32)  # written: pages faulted in
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: faults dst's pages in outside the timing
    seconds = []
    for _ in range(COPIES):
        t0 = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - t0)
    return round(2 * src.nbytes / statistics.median(seconds) / 1e9, 2)


def _unknown_why(report: DeviceReport) -> str:
    if report.gpu is None:
        return "no CUDA GPU to compare with"
    if report.gpu_numa_node is None:
        return "the GPU's sysfs numa_node is -1 or missing (one node, or a VM hiding it)"
    return "sysfs lists no NUMA node for the bound cores"


def judge(report: DeviceReport, node_cpulists: Mapping[int, str], strict: bool) -> int:
    """Warn loudly on a NUMA mismatch; the exit code: 1 for a mismatch under --strict."""
    if report.numa != "mismatch":
        return 0
    assert report.gpu is not None and report.gpu_numa_node is not None
    local = node_cpulists.get(report.gpu_numa_node, "").strip() or "none listed"
    log.warning(
        "numa_mismatch",
        gpu_id=report.gpu.id,
        gpu_numa_node=report.gpu_numa_node,
        cores=format_cores(report.cores),
        core_numa_nodes=report.core_numa_nodes,
    )
    print(
        f"WARNING: NUMA mismatch: GPU {report.gpu.id} is on node {report.gpu_numa_node} but "
        f"cores {format_cores(report.cores)} are on node(s) {report.core_numa_nodes}; every "
        "host <-> GPU copy crosses the socket link. Bind to node "
        f"{report.gpu_numa_node}'s cores instead: --cpu-cores {local}"
    )
    return 1 if strict else 0


def print_report(report: DeviceReport) -> None:
    nodes = ",".join(map(str, report.core_numa_nodes)) or "unknown"
    print("\ndevice_checker")
    cores = format_cores(report.cores)
    print(f"  cores      {cores} ({len(report.cores)} cores), NUMA node(s) {nodes}")
    gpu = report.gpu
    if gpu is None:
        print(f"  GPU        no CUDA GPU: {report.no_gpu_reason}")
    else:
        node = "unknown" if report.gpu_numa_node is None else report.gpu_numa_node
        print(
            f"  GPU {gpu.id:<6} {gpu.name}, {gpu.memory_gib:.1f} GiB, compute capability "
            f"{gpu.compute_capability}, PCI {gpu.pci_bus_id or 'unknown'}, NUMA node {node}"
        )
        print(
            f"  PCIe       H2D {gpu.h2d_gbs:.1f} GB/s, D2H {gpu.d2h_gbs:.1f} GB/s "
            f"(pinned, {PCIE_MIB} MiB, median of {COPIES})"
        )
    print(
        f"  host copy  {report.host_copy_gbs:.1f} GB/s on the bound cores ({HOST_MIB} MiB "
        "float32, read + write counted; the figure for device_topology.cpu.bandwidth_gbps)"
    )
    if report.numa == "match":
        print(f"  NUMA       match: the cores and the GPU share node {report.gpu_numa_node}")
    elif report.numa == "unknown":
        print(f"  NUMA       unknown: {_unknown_why(report)}")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--gpu-id", type=int, default=0, help="CUDA device index (default 0)")
    ap.add_argument(
        "--cpu-cores", help='cores to bind, as "0-15" or "0,2,4-7" (default: current affinity)'
    )
    ap.add_argument("--strict", action="store_true", help="exit 1 on a NUMA mismatch")
    ap.add_argument("--json", metavar="PATH", type=Path, help="also write the figures as JSON")
    return ap.parse_args(argv)


def _bind(args: argparse.Namespace) -> list[int]:
    """Validate --cpu-cores and --gpu-id, then bind; exit 2 on a bad value."""
    try:
        available = os.sched_getaffinity(0)
        cores = sorted(available)
        if args.cpu_cores is not None:
            cores = parse_cores(args.cpu_cores, available)
        if no_gpu_reason() is None:
            check_gpu_id(args.gpu_id, torch.cuda.device_count())
    except ConfigError as exc:
        print(f"device_checker: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    # torch sized its pool for the whole machine; the CPU daemon runs one thread per bound core
    return bind(cores, "--cpu-cores")


def main(argv: list[str] | None = None) -> DeviceReport:
    args = _args(argv)
    hlog.configure()
    cores = _bind(args)
    reason = no_gpu_reason()
    gpu = probe_gpu(args.gpu_id) if reason is None else None
    node_cpulists = read_node_cpulists(SYSFS_ROOT)
    core_nodes = numa_nodes_of_cores(cores, node_cpulists)
    gpu_node = read_gpu_numa(gpu.pci_bus_id, SYSFS_ROOT) if gpu and gpu.pci_bus_id else None
    report = DeviceReport(
        cores=cores,
        core_numa_nodes=core_nodes,
        gpu=gpu,
        no_gpu_reason=reason,
        gpu_numa_node=gpu_node,
        numa=compare(gpu_node, core_nodes),
        host_copy_gbs=host_copy_gbs(),
    )
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=2) + "\n")
    code = judge(report, node_cpulists, args.strict)
    if code:
        raise SystemExit(code)
    return report


if __name__ == "__main__":
    main()
