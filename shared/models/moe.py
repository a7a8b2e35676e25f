"""Mixtral's sparse mixture-of-experts block, which replaces the dense MLP of a decoder layer.

A router scores every expert for each token and keeps the top k; each kept expert is an
ordinary SwiGLU MLP that sees only the tokens routed to it, so a step costs one matmul pair
per *active* expert. The router (`route`) and the per-expert call (`run_expert`) stay separate
methods: expert offloading hooks in at `run_expert`, without touching the routing.

Order of operations and dtypes follow transformers' MixtralSparseMoeBlock, so fp32 results are
HF's to the last bit up to matmul blocking:
  logits = x W_gate^T (model dtype) -> softmax in fp32 -> top-k -> divide by their sum (fp32);
  out[t] = sum over its experts, ascending id, of (expert_e(x[t]) * w[t, e]).to(model dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridgen.kernels import ops
from hybridgen.models.spec import ModelSpec


class SparseMoeBlock(nn.Module):
    """`gate` ([E, H] router weight) and `experts` (E dense MLPs); names follow HF's `mlp.`."""

    def __init__(self, spec: ModelSpec, expert: Callable[[ModelSpec], nn.Module]) -> None:
        super().__init__()
        self.num_experts, self.top_k = spec.num_local_experts, spec.num_experts_per_tok
        self.gate = nn.Linear(spec.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(expert(spec) for _ in range(self.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (expert ids [T, k] int64, weights [T, k] fp32 summing to 1 per token)."""
        logits = ops.linear(x, self.gate.weight)  # [T, E] in model dtype, as HF
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x: [N, H], the tokens routed to `expert` -> its MLP output [N, H]."""
        return self.experts[expert](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = torch.zeros_like(x)  # [T, H]
        # Ascending expert order fixes each token's summation order (HF's, too).
        for expert in torch.unique(ids).tolist():
            tokens, slot = torch.where(ids == expert)  # [N], [N]: token and its top-k position
            y = self.run_expert(expert, x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        return out
