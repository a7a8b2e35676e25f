"""Loading a dense model with its decoder layers from `host_from` on straight into host
memory (weights.gpu_layers, models/host_layers.py), so that the device never holds more
than the resident layers and the staging slots: a model larger than the device loads.

A checkpoint (HF folder or GGUF) is read into host tensors for those layers' projections
(and, for weights.format int8 / int4, quantized there in chunks that the device computes);
a synthetic preset draws each such projection on the device with the generator in the
model's own order (the same model as drawn resident), quantizes it there when asked, and
keeps only the result, in host memory: llama3-70b in int4 never has its bf16 weights (141 GB)
anywhere at once, one projection at a time instead.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridgen.models.dense_quant import QuantLinear, WeightFormat, quantize
from hybridgen.models.host_layers import PARTS
from hybridgen.models.llama import CausalLM
from hybridgen.models.spec import ModelSpec

CPU = torch.device("cpu")


def empty_split_model(
    spec: ModelSpec, device: torch.device, host_from: int, host_device: torch.device
) -> CausalLM:
    """A dense model with uninitialised weights in spec.dtype: layers[host_from:]'s
    projections on `host_device` (the CPU, or meta for weights drawn apart:
    `keep_on_host`), everything else on `device`."""
    with torch.device("meta"):
        net = CausalLM(spec).to(spec.dtype)
    held = []
    for layer in net.layers[host_from:]:
        for path in PARTS:
            owner_path, _, name = path.rpartition(".")
            owner = layer.get_submodule(owner_path)
            held.append((owner, name, getattr(owner, name)))
            setattr(owner, name, nn.Identity())
    net = net.to_empty(device=device)
    for owner, name, module in held:
        setattr(
            owner,
            name,
            module if host_device.type == "meta" else module.to_empty(device=host_device),
        )
    if spec.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    return net


def keep_on_host(model: CausalLM, name: str, value: torch.Tensor, fmt: WeightFormat) -> None:
    """Parameter `name` (a host projection's weight or bias, still meta) takes `value`, drawn
    on the device: in host memory, the weight quantized first (on the device) for int8 /
    int4."""
    path, _, kind = name.rpartition(".")
    module = model.get_submodule(path)
    if kind == "weight" and fmt != "native":
        owner_path, _, attr = path.rpartition(".")
        quant = quantize(value, fmt)  # type: ignore[arg-type]
        setattr(model.get_submodule(owner_path), attr, QuantLinear(quant.to(CPU), None))
        return
    setattr(module, kind, nn.Parameter(value.to(CPU), requires_grad=False))
