"""HF transformers' model of a preset's shape with random weights, dispatched by accelerate's
big-model offloading within a device budget: the baseline B4 (moe_bench) and B7
(dense_offload_bench) set ours beside.

`infer_auto_device_map` fills device 0 up to the budget in module order (a decoder layer never
split, room kept for the largest module) and puts the rest in host memory; `dispatch_model`
then copies each host module's weights to the device at every forward and drops them after,
from pageable memory, as `from_pretrained(device_map="auto")` leaves them. The weights are
made where they will live: the model is built on the meta device, the device map computed
from it, and each parameter created on its own device and drawn on the fastest one, so no
full copy is ever made in host memory (llama3-70b's bf16 weights, 141 GB, exceed the H200
machine's 128 GB) and nothing is drawn by the slow CPU generator when a GPU is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridgen.benchmarks.hf_baseline import hf_config
from hybridgen.models.spec import ModelSpec
from hybridgen.runtime import log as hlog

DEVICE = 0
"""accelerate's name for the device the budget is for."""
HOST = "cpu"
"""accelerate's name for host memory."""
Placement = int | str


@dataclass(frozen=True)
class Offloaded:
    """An HF model with random weights, placed by accelerate within a budget."""

    model: Any
    """The HF model: on the meta device from `place`; from `build` dispatched on CUDA, or
    whole on the CPU without CUDA."""
    device_map: dict[str, Placement]
    """accelerate's placement for the budget: DEVICE or HOST, by module name."""
    dtype: torch.dtype
    """bf16 on CUDA (what accelerate's users run), fp32 on the CPU."""
    cuda: bool
    """Whether the DEVICE modules run on CUDA (else the CPU runs every module)."""

    @property
    def devices(self) -> list[str]:
        """Where the modules run: the map's placements on CUDA, only the CPU without it."""
        return sorted({str(d) for d in self.device_map.values()}) if self.cuda else [HOST]


def meta_model(spec: ModelSpec, dtype: torch.dtype) -> Any:
    """The HF model of `spec` with its parameters on the meta device (no memory), tied ones
    tied (so the map counts them once), and its buffers (the rotary frequencies) computed on
    the CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=dtype)
    model.tie_weights()
    return model


def budget_map(model: Any, budget_mb: float) -> dict[str, Placement]:
    """accelerate's device map for `model` with `budget_mb` MiB on DEVICE and the rest in
    host memory, a decoder layer never split (as B4 and B7 run it)."""
    from accelerate import infer_auto_device_map

    layer_class = type(model.model.layers[0]).__name__  # LlamaDecoderLayer, MixtralDecoderLayer
    budget: dict[int | str, int | str] = {DEVICE: int(budget_mb * 2**20), HOST: "1000GiB"}
    found = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=[layer_class])
    return dict(found)


def placement_of(device_map: dict[str, Placement], name: str) -> Placement:
    """The placement of module or parameter `name`: its own entry or its nearest ancestor's
    (accelerate groups a module whose children all share one placement)."""
    parts = name.split(".")
    for end in range(len(parts), -1, -1):
        key = ".".join(parts[:end])
        if key in device_map:
            return device_map[key]
    raise KeyError(f"{name} is in no entry of the device map")


def placed_bytes(model: Any, device_map: dict[str, Placement]) -> dict[str, int]:
    """Parameter bytes kept on the device and in host memory ("device", "host"), each tied
    tensor once; valid on the meta model (no memory read)."""
    kept = {"device": 0, "host": 0}
    for name, p in model.named_parameters():
        side = "host" if placement_of(device_map, name) == HOST else "device"
        kept[side] += p.numel() * p.element_size()
    return kept


def _fill(t: torch.Tensor, draw_on: torch.device, gen: torch.Generator) -> None:
    """Norms to one, matrices to N(0, 0.02) drawn on `draw_on`, one expert of a stack at a
    time (a CPU generator takes about 10 s per Mixtral expert stack, a CUDA one milliseconds)."""
    if t.dim() == 1:
        t.fill_(1.0)
        return
    for part in t.split(1) if t.dim() > 2 else [t]:
        if part.device == draw_on:
            part.normal_(0.0, 0.02, generator=gen)
        else:
            drawn = torch.empty(part.shape, dtype=part.dtype, device=draw_on)
            part.copy_(drawn.normal_(0.0, 0.02, generator=gen))


@torch.no_grad()
def materialize(model: Any, device_map: dict[str, Placement], cuda: bool) -> None:
    """Each meta parameter made where the map puts it (DEVICE on CUDA, else the CPU) and
    filled with random weights drawn on CUDA when there is one; tied weights re-tied."""
    draw_on = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(device=draw_on).manual_seed(0)
    params = list(model.named_parameters())
    progress = hlog.Progress("baseline_weights", len(params), unit="tensors")
    for i, (name, p) in enumerate(params):
        on_device = cuda and placement_of(device_map, name) == DEVICE
        t = torch.empty(p.shape, dtype=p.dtype, device="cuda" if on_device else "cpu")
        _fill(t, draw_on, gen)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        progress.update(i + 1)
    model.tie_weights()


def place(spec: ModelSpec, budget_mb: float, cuda: bool) -> Offloaded:
    """HF's model of `spec` on the meta device, placed by accelerate within `budget_mb` MiB:
    what `build` will make, its sizes readable before any memory is taken."""
    dtype = torch.bfloat16 if cuda else torch.float32
    model = meta_model(spec, dtype)
    return Offloaded(model, budget_map(model, budget_mb), dtype, cuda)


def build(placed: Offloaded) -> Offloaded:
    """`placed`'s random weights made where the map puts them and, on CUDA, the model
    dispatched (peak memory statistics reset after the weights are made, so that the peak is
    the resident weights and what the forwards add); without CUDA the whole model runs on the
    CPU and the map only says where accelerate would keep each module."""
    from accelerate import dispatch_model

    model = placed.model
    materialize(model, placed.device_map, placed.cuda)
    if placed.cuda:
        torch.cuda.empty_cache()  # the draws' temporaries
        torch.cuda.reset_peak_memory_stats()
        model = dispatch_model(model, device_map=placed.device_map)
    return Offloaded(model.eval(), placed.device_map, placed.dtype, placed.cuda)
