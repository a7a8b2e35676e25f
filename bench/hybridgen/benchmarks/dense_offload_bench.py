"""B7's baseline (issue 23): a dense model bigger than its device under accelerate's offloading.

    python -m hybridgen.benchmarks.dense_offload_bench --model llama3-70b --budget-mb 24576 \\
        --prompt-len 1024 --max-new-tokens 64 [--layers N] [--device auto|cpu] \\
        [--out bench/results/dense_offload.json]

HF transformers' model of the preset's shape (LlamaForCausalLM for llama3-70b), random weights,
placed by accelerate within the budget (`infer_auto_device_map`, a decoder layer never split)
and dispatched (`dispatch_model`): the layers that fit stay on the device, the others in host
memory, each copied to the device at every forward (accelerate_offload.py). It runs bf16:
accelerate cannot run HybridGen's int4 format, so this is what a user of accelerate gets, with
twice int4's bytes (and more than twice the host share) to move. One random prompt of
--prompt-len tokens, --max-new-tokens greedy at batch 1, after an untimed one-token warm-up;
reported: decode tok/s, TTFT (the prefill), bytes kept on the device and in host memory, peak
reserved device memory.

--layers N cuts the model to its first N decoder layers, for when its bf16 weights do not fit
in host memory (llama3-70b: 141 GB against the H200 machine's 128 GB). Everything under
`measured` is the cut model as it ran. Each decoder layer's calls are timed (from its forward
pre-hook to its forward hook, which enclose accelerate's copy of a host layer's weights; CUDA
events, no synchronisation added), and `full_depth` is derived from them: the measured step
less its layers' times is the rest (embedding, final norm, the output head's copy, sampling,
generate's own work); the full depth's step is that rest plus its device layers times the
mean device layer and its host layers times the mean host layer, with the placement
accelerate gives the full-depth model in the same budget (computed on the meta device, not
run): the first layers fill the same device share, the extra layers all go to host memory.
Without --layers (or N = the preset's depth) `full_depth` is the measured run itself.

Each offloaded step moves the same bytes, so a few new tokens give the rate of 64:
`bench/run_h200_served.sh b7_hf` runs 4. The JSON is written once placed (status "placed",
so a run cut short still says what it ran) and again when measured; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import torch

from hybridgen.benchmarks.accelerate_offload import (
    HOST,
    Offloaded,
    build,
    place,
    placed_bytes,
    placement_of,
)
from hybridgen.benchmarks.engine_bench import random_prompts
from hybridgen.benchmarks.hf_baseline import timed_generate
from hybridgen.benchmarks.report import machine_info
from hybridgen.engine.host_memory import AVAILABLE_SHARE, available_bytes
from hybridgen.models.presets import preset_spec
from hybridgen.runtime import log as hlog

log = structlog.get_logger()

KINDS = ("device", "host")
"""Where a decoder layer is kept: on the device, or in host memory (copied in each forward)."""
BASELINE = (
    "HF transformers under accelerate (infer_auto_device_map, dispatch_model), random "
    "weights; accelerate cannot run HybridGen's int4 format, so it runs bf16 on CUDA, what its "
    "users get (fp32 on the CPU)"
)
"""What the results measure, in their own words."""
RAN_ON = {
    True: "cuda: the device layers resident, the host layers copied in at each forward",
    False: "cpu: no CUDA, every module ran on the CPU; the map is where accelerate keeps each",
}
"""Where the modules ran, by whether CUDA did."""


class LayerClock:
    """Every call of each decoder layer timed, from its forward pre-hook to its forward hook
    (they enclose accelerate's hook, so a host layer's time includes its weights' copy):
    CUDA events recorded on the current stream (no synchronisation added), else the wall
    clock."""

    def __init__(self, layers: list[torch.nn.Module], cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[list[tuple[Any, Any]]] = [[] for _ in layers]
        self.open: list[Any] = [None] * len(layers)
        self.handles = [
            handle
            for i, layer in enumerate(layers)
            for handle in (
                layer.register_forward_pre_hook(partial(self._start, i)),
                layer.register_forward_hook(partial(self._stop, i)),
            )
        ]

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self, i: int, *_: Any) -> None:
        self.open[i] = self._now()

    def _stop(self, i: int, *_: Any) -> None:
        self.marks[i].append((self.open[i], self._now()))

    def call_ms(self) -> list[list[float]]:
        """Each layer's calls, in order, in milliseconds; the hooks removed."""
        for handle in self.handles:
            handle.remove()
        if self.cuda:
            torch.cuda.synchronize()
            return [[a.elapsed_time(b) for a, b in calls] for calls in self.marks]
        return [[(b - a) * 1e3 for a, b in calls] for calls in self.marks]


def layer_kinds(device_map: dict[str, Any], layers: int) -> list[str]:
    """Each decoder layer's kind ("device" or "host") in accelerate's map."""
    return [
        "host" if placement_of(device_map, f"model.layers.{i}") == HOST else "device"
        for i in range(layers)
    ]


def layer_bytes(placed: Offloaded) -> int:
    """The parameter bytes of one decoder layer (all alike in a dense model)."""
    return sum(p.numel() * p.element_size() for p in placed.model.model.layers[0].parameters())


def placement(placed: Offloaded, layers: int) -> dict[str, Any]:
    """Layers and parameter bytes by where accelerate keeps them."""
    kinds = layer_kinds(placed.device_map, layers)
    kept = placed_bytes(placed.model, placed.device_map)
    return {
        "layers": layers,
        "device_layers": kinds.count("device"),
        "host_layers": kinds.count("host"),
        "device_bytes": kept["device"],
        "host_bytes": kept["host"],
        "layer_bytes": layer_bytes(placed),
    }


def _outside_layers(device_map: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in device_map.items() if not k.startswith("model.layers")}


def cut_problem(args: argparse.Namespace, full: Offloaded, cut: Offloaded) -> str | None:
    """Why --layers cannot stand for the full depth, or cannot fit in host memory; None when
    it can. A cut times a layer of each kind the full depth has only when it reaches past the
    device's share (accelerate fills the device from the front, then puts every later module
    in host memory)."""
    total = preset_spec(args.model).num_layers
    kinds = layer_kinds(full.device_map, total)
    lo = kinds.count("device") + 1 if "host" in kinds else 1
    if not lo <= args.layers <= total:
        return f"argument --layers: {args.layers} is not in [{lo}, {total}] for this budget"
    assert _outside_layers(cut.device_map) == _outside_layers(full.device_map)
    kept = placed_bytes(cut.model, cut.device_map)
    need = kept["host"] if cut.cuda else kept["host"] + kept["device"]
    room = available_bytes()
    if room is None or need <= AVAILABLE_SHARE * room:
        return None
    fits = args.layers - int((need - AVAILABLE_SHARE * room) // layer_bytes(cut) + 1)
    return (
        f"argument --layers: {args.layers} layers need {need / 1e9:.1f} GB of host memory, "
        f"{AVAILABLE_SHARE:.0%} of the {room / 1e9:.1f} GB available is less: at most {fits}"
    )


def kind_means(call_ms: list[list[float]], kinds: list[str], calls: slice) -> dict[str, float]:
    """The mean ms of a layer of each kind present, over the calls selected."""
    means = {}
    for kind in KINDS:
        times = [t for ms, k in zip(call_ms, kinds, strict=True) if k == kind for t in ms[calls]]
        if times:
            means[kind] = sum(times) / len(times)
    return means


def layers_ms(layer_ms: dict[str, float], counts: dict[str, Any]) -> float:
    """The time of `counts`' decoder layers (its device_layers and host_layers) at the mean
    time of a layer of each kind."""
    return sum(counts[f"{kind}_layers"] * ms for kind, ms in layer_ms.items())


def measure(args: argparse.Namespace, placed: Offloaded) -> dict[str, Any]:
    """The cut model built and run: TTFT, decode tok/s and each kind's mean layer time in
    the timed run's prefill and decode steps."""
    off = build(placed)
    layers = list(off.model.model.layers)
    clock = LayerClock(layers, off.cuda)
    ids = torch.tensor(random_prompts(1, args.prompt_len, off.model.config.vocab_size, seed=1))
    ids = ids.to("cuda" if off.cuda else "cpu")
    ttft_s, tok_s = timed_generate(off.model, ids, args.max_new_tokens)
    call_ms = clock.call_ms()
    n = args.max_new_tokens  # the warm-up's one forward, then the timed run's n
    assert all(len(ms) == n + 1 for ms in call_ms), "one call a forward"
    kinds = layer_kinds(off.device_map, len(layers))
    result: dict[str, Any] = {
        "ttft_ms": ttft_s * 1e3,
        "decode_tok_s": tok_s,
        "prefill_layer_ms": kind_means(call_ms, kinds, slice(1, 2)),
        "decode_layer_ms": kind_means(call_ms, kinds, slice(2, None)),
    }
    if off.cuda:
        result["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
        result["within_budget"] = result["peak_reserved_mb"] <= args.budget_mb
    return result


def add_rest(measured: dict[str, Any], cuda: bool) -> None:
    """What each measured step took besides its decoder layers (the embedding, the final norm,
    the output head and its copy, sampling, generate's own work), and on CUDA a host layer's
    rate (its bytes over its mean decode time, the copy in it)."""
    step_ms = 1e3 / measured["decode_tok_s"]
    measured["decode_rest_ms"] = step_ms - layers_ms(measured["decode_layer_ms"], measured)
    prefill = layers_ms(measured["prefill_layer_ms"], measured)
    measured["prefill_rest_ms"] = measured["ttft_ms"] - prefill
    if cuda and "host" in measured["decode_layer_ms"]:
        host_ms = measured["decode_layer_ms"]["host"]
        measured["host_layer_gb_s"] = measured["layer_bytes"] / host_ms / 1e6


def full_depth(measured: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """The full depth's TTFT and decode tok/s: measured when the full depth ran, else each
    step's measured rest plus the full depth's layers at the measured mean layer times."""
    if measured["layers"] == full["layers"]:
        ran = {k: measured[k] for k in ("ttft_ms", "decode_tok_s")}
        return {**full, **ran, "derived": "measured: the full depth ran"}
    decode_ms = measured["decode_rest_ms"] + layers_ms(measured["decode_layer_ms"], full)
    ttft_ms = measured["prefill_rest_ms"] + layers_ms(measured["prefill_layer_ms"], full)
    derived = (
        f"not run: the measured rest of a step + {full['device_layers']} device layers x the "
        f"measured mean device layer + {full['host_layers']} host layers x the measured mean "
        f"host layer, for the prefill (TTFT) and for a decode step; the rest is the measured "
        f"step less its {measured['device_layers']} device and {measured['host_layers']} "
        "host layers; the layer counts are accelerate's placement of the full-depth model "
        "in the same budget"
    )
    return {**full, "ttft_ms": ttft_ms, "decode_tok_s": 1e3 / decode_ms, "derived": derived}


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\nB7 accelerate: model={result['model']} dtype={result['dtype']} "
        f"budget={result['budget_mb']:g} MiB commit={result['machine']['commit']}"
    )
    head = ("decode tok/s", "TTFT ms", "dev layers", "host layers", "device GB", "host GB")
    print(f"{'depth':22} " + " ".join(f"{h:>12}" for h in head))
    for name in ("measured", "full_depth"):
        r = result[name]
        how = "derived" if r.get("derived", "").startswith("not run") else "measured"
        label = f"{r['layers']} layers, {how}"
        cells = [
            f"{r['decode_tok_s']:12.3f}",
            f"{r['ttft_ms']:12.0f}",
            f"{r['device_layers']:12d}",
            f"{r['host_layers']:12d}",
            f"{r['device_bytes'] / 1e9:12.2f}",
            f"{r['host_bytes'] / 1e9:12.2f}",
        ]
        print(f"{label:22} " + " ".join(cells))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--budget-mb", type=float, default=24576.0)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None, help="cut to the first N layers")
    ap.add_argument("--out", type=Path, default=Path("bench/results/dense_offload.json"))
    return ap


def _write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    spec = preset_spec(args.model)
    args.layers = args.layers or spec.num_layers
    if args.prompt_len < 1 or args.max_new_tokens < 2 or args.budget_mb <= 0:
        ap.error("need --prompt-len >= 1, --max-new-tokens >= 2 and --budget-mb > 0")
    hlog.configure()
    cuda = torch.cuda.is_available() and args.device != "cpu"
    full = place(spec, args.budget_mb, cuda)
    cut = place(replace(spec, num_layers=args.layers), args.budget_mb, cuda)
    problem = cut_problem(args, full, cut)
    if problem is not None:
        ap.error(problem)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(["python -m hybridgen.benchmarks.dense_offload_bench", *argv]),
        "model": args.model,
        "synthetic": spec.synthetic,
        "architecture": spec.architecture,
        "baseline": BASELINE,
        "ran_on": RAN_ON[cuda],
        "dtype": str(cut.dtype).removeprefix("torch."),
        "budget_mb": args.budget_mb,
        "prompt_len": args.prompt_len,
        "new_tokens": args.max_new_tokens,
        "batch": 1,
        "status": "placed",
        "measured": placement(cut, args.layers),
        "full_depth": placement(full, spec.num_layers),
    }
    _write(result, args.out)
    log.info("dense_offload_placed", **result["measured"])
    result["measured"].update(measure(args, cut))
    add_rest(result["measured"], cuda)
    result["full_depth"] = full_depth(result["measured"], result["full_depth"])
    result["status"] = "measured"
    _write(result, args.out)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
