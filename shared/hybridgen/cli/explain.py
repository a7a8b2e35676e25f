"""What `hybridgen serve --explain` prints beyond the op-region table: the spill decision
(kv_cache.spill_policy) with its measured inputs, the prefix cache by tier, and the decoder
layers by placement (weights.gpu_layers), read from GetModelInfo."""

from __future__ import annotations

from typing import Any

CHOICES = ("wait", "swap", "turns", "spill")


def _figure(value: float, unit: str) -> str:
    return "not measured yet" if value < 0 else f"{value:.3g} {unit}"


def spill_lines(info: Any) -> list[str]:
    """The spill decision: policy, decisions so far, the last one's predictions, the inputs
    (a GetModelInfoResponse, or anything with its field names)."""
    if info.spill_policy in ("", "off"):
        return ["spill policy: off (no Warm tier: a sequence that does not fit Hot waits)"]
    counts = ", ".join(f"{c} {getattr(info, f'spill_decisions_{c}')}" for c in CHOICES)
    lines = [f"spill policy: {info.spill_policy}; decisions so far: {counts}"]
    if info.spill_last_choice:
        weighed = [
            f"{c} {getattr(info, f'spill_predicted_{c}_s'):.3g} s"
            for c in CHOICES
            if getattr(info, f"spill_predicted_{c}_s") >= 0
        ]
        sums = f" (predicted completion sums: {', '.join(weighed)})" if weighed else ""
        lines.append(f"  last: {info.spill_last_choice}{sums}")
    lines.append(
        "  inputs: decode step "
        + _figure(info.spill_decode_step_ms, "ms")
        + ", prefill of the candidate "
        + _figure(info.spill_prefill_ms, "ms")
        + ", a step holding Warm "
        + _figure(info.spill_warm_step_ms, "ms")
        + " beyond its blocks, a Warm block read "
        + _figure(info.spill_warm_block_us, "us")
        + " a step, a block moved Hot <-> Warm "
        + _figure(info.spill_move_block_us, "us")
    )
    return lines


def prefix_lines(info: Any) -> list[str]:
    """The prefix cache: hits and tokens not computed, by tier; blocks kept for reuse."""
    tiers = ", ".join(
        f"{t} {getattr(info, f'prefix_{t}_hits')} requests / {getattr(info, f'prefix_{t}_tokens')}"
        " tokens"
        for t in ("hot", "warm", "cold")
    )
    return [
        f"prefix cache: {info.prefix_cached_tokens} prompt tokens not computed ({tiers}); "
        f"{info.warm_kept_blocks} finished blocks kept in Warm, {info.warm_keep_skipped} "
        f"write-backs skipped as not paying ({info.warm_keep_recomputed} of their blocks "
        f"computed again), {info.warm_keep_failed} failed, "
        f"{info.cold_blocks} blocks in Cold"
    ]


def layer_lines(info: Any) -> list[str]:
    """Decoder layers by placement: resident, and host ones with how they ran so far and the
    bytes they moved per token."""
    if not info.host_layers:
        return [f"decoder layers: all {info.gpu_layers} on the device"]
    return [
        f"decoder layers: {info.gpu_layers} on the device, {info.host_layers} in host memory "
        f"({info.host_layer_bytes / 2**20:.3g} MiB each; host_layer_compute "
        f"{info.host_layer_compute}, CPU share of each layer's weight bytes "
        f"{info.host_split_fraction:.3g}); host layer-steps so far: {info.cpu_layer_steps} "
        f"on the CPU, {info.split_layer_steps} split, {info.streamed_layer_steps} streamed; "
        f"{info.host_bytes_per_token:.4g} bytes moved and {info.host_cpu_ms_per_token:.3g} ms "
        "of CPU per token",
        f"host layers by step: {host_steps(info)}",
    ]


def host_steps(info: Any) -> str:
    """How a step computes the host layers (models/host_layers.HostLayers.choose): by its
    token count under auto on CUDA (decode on the host side, prefill chunks streamed), else
    every step one way."""
    where = "on the CPU" if info.host_split_fraction >= 1 else "split between the CPU and the link"
    if info.host_layer_compute == "stream":
        return "every step streams their weights to the device"
    if info.host_layer_max_tokens:
        return (
            f"steps of up to {info.host_layer_max_tokens} tokens (decode) compute them {where}, "
            "larger ones (prefill chunks) stream their weights to the device"
        )
    return f"every step computes them {where}"
