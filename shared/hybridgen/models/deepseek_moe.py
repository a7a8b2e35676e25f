"""DeepSeek-V2's sparse MoE block: SparseMoeBlock (moe.py) with DeepSeek's router.

The router follows transformers' DeepseekV2TopkRouter op for op: logits in fp32 (the input
and the gate weight both cast up), softmax in fp32; `group_limited_greedy` splits the experts
into `expert_groups` groups, keeps the `topk_groups` groups with the highest best expert score
and zeroes the others' scores; then the top k (greedy: over all experts) and the weights times
`routed_scaling_factor`, never renormalised (norm_topk_prob true is refused at load). The
shared experts are SparseMoeBlock's ungated shared expert (ModelSpec.shared_expert_gated
False), so Cold-Weights, the device cache and the piecewise CUDA graphs run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridgen.models.moe import SparseMoeBlock
from hybridgen.models.spec import ModelSpec


class DeepseekMoeBlock(SparseMoeBlock):
    """`gate` [E, H], `experts`, and `shared_expert` (HF's `shared_experts`, no gate)."""

    def __init__(self, spec: ModelSpec, expert: Callable[[ModelSpec, int], nn.Module]) -> None:
        super().__init__(spec, expert)
        self.groups, self.topk_groups = spec.expert_groups, spec.topk_groups
        self.scaling = spec.routed_scaling_factor

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> every expert's score [T, E] in fp32, as HF computes them."""
        return F.linear(x.float(), self.gate.weight.float())

    def logits_dtype(self) -> torch.dtype:
        return torch.float32

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_top_k(logits, self.top_k, self.groups, self.topk_groups, self.scaling)


def grouped_top_k(
    logits: torch.Tensor, k: int, groups: int, topk_groups: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's pick from router logits [T, E] -> (expert ids [T, k], fp32 weights
    [T, k]): softmax, only the best `topk_groups` of `groups` expert groups (all of them
    when equal: greedy), the top k, times `scaling`."""
    scores = torch.softmax(logits.float(), dim=-1)
    if topk_groups < groups:
        t, e = scores.shape
        group_best = scores.view(t, groups, e // groups).max(dim=-1).values  # [T, groups]
        kept = torch.topk(group_best, topk_groups, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_best).scatter_(1, kept, 1.0)
        mask = mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)
        scores = scores.masked_fill(~mask.bool(), 0.0)
    weights, ids = torch.topk(scores, k, dim=-1, sorted=False)
    return ids, weights * scaling
