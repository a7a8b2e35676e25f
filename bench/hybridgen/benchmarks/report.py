"""What every benchmark result records about where it ran, and its closing table."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from typing import Any

import torch


def git_commit() -> str:
    """HYBRIDGEN_COMMIT when set (the device copy of the tree has no .git), else git's HEAD."""
    if os.environ.get("HYBRIDGEN_COMMIT"):
        return os.environ["HYBRIDGEN_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": git_commit(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name, gpu_memory_mb=props.total_memory // 2**20, cuda=torch.version.cuda
        )
    try:
        import transformers
        import triton

        info.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    return info


def write_out(name: str, result: dict[str, Any]) -> None:
    """result as JSON in $OUT/name, when OUT is set (the device tool's folder of results)."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(result, f, indent=1)


def print_table(result: dict[str, Any]) -> None:
    """The engine benchmark's summary: ours vs HF per batch size."""
    hf = result.get("hf", {}).get("timings", {})
    print(
        f"\nmodel={result['model']} synthetic={result['synthetic']} "
        f"gpu={result['machine'].get('gpu', 'none')} commit={result['machine']['commit'][:10]}"
    )
    print(
        f"{'batch':>5} {'ttft_ms':>9} {'decode_tok/s':>13} {'total_tok/s':>12} "
        f"{'hf_decode_tok/s':>16} {'ratio':>7}"
    )
    for b, ours in result["ours"].items():
        theirs = hf.get(b, {}).get("decode_tok_s")
        ratio = f"{ours['decode_tok_s'] / theirs:7.1f}" if theirs else f"{'-':>7}"
        hf_s = f"{theirs:16.1f}" if theirs else f"{'-':>16}"
        print(
            f"{b:>5} {ours['ttft_ms']:9.1f} {ours['decode_tok_s']:13.1f} "
            f"{ours['total_tok_s']:12.1f} {hf_s} {ratio}"
        )
    if "peak_reserved_mb" in result:
        print(
            f"peak reserved {result['peak_reserved_mb']:.0f} MiB of budget "
            f"{result['memory_plan']['budget_mb']:.0f} MiB"
        )
    for row in result.get("hf", {}).get("logits_check", []):
        print(
            f"logits len={row['prompt_len']}: "
            f"rel err vs HF bf16 {row['rel_err_vs_hf_bf16']:.2e}, "
            f"vs HF fp32 {row['rel_err_vs_hf_fp32']:.2e} (HF bf16 vs fp32 "
            f"{row['hf_bf16_rel_err_vs_hf_fp32']:.2e}), top1 {row['top1_agrees_with_hf_fp32']}"
        )
