"""The GPU memory budget: weights, step workspace and the KV block pool (plan_engine_memory).

`device_topology.gpu.memory_mb` is a hard budget for everything the engine allocates on its
device. The plan is made before any KV is allocated:

    budget = weights + workspace + kv_pool      (kv_pool = num_blocks * block_bytes)

The workspace bound covers the largest transient tensors of one step (activations of
max_num_batched_tokens tokens, the logits and sampler temporaries of max_num_seqs rows, the
rope tables, CUDA-graph buffers), each counted at its real size. On CUDA the caching
allocator is also capped at the budget, so an underestimate fails loudly instead of
silently overrunning; peak reserved memory is reported after every benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.cuda_graphs import graph_sizes
from hybridgen.engine.model_runner import profile_step_peak
from hybridgen.kernels import ops
from hybridgen.kernels.kv_quant import hot_kv_bytes_per_token
from hybridgen.models.llama import CausalLM
from hybridgen.models.moe import SparseMoeBlock
from hybridgen.models.rope import max_model_len as model_max_len
from hybridgen.models.spec import ModelSpec

log = structlog.get_logger()

MIB = 1 << 20


class BudgetTooSmall(ValueError):
    """The memory budget cannot hold the weights, the workspace and one full sequence."""


@dataclass(frozen=True)
class MemoryPlan:
    """How the budget is split; every figure in bytes."""

    budget: int
    """The whole budget."""
    weights: int
    """Parameters as loaded (what stays on the device), plus a Cold-Weights expert cache."""
    workspace: int
    """Upper bound of transient tensors in one step."""
    block_bytes: int
    """K and V of one block over all layers."""
    num_blocks: int
    """Blocks in the KV pool."""
    min_blocks: int = 0
    """Fewest blocks the pool may have (a whole sequence, or a step's chunk with Warm)."""

    @property
    def kv_pool(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def planned_peak(self) -> int:
        return self.weights + self.workspace + self.kv_pool

    def summary(self) -> dict[str, float]:
        return {
            "budget_mb": self.budget / MIB,
            "weights_mb": self.weights / MIB,
            "workspace_mb": self.workspace / MIB,
            "kv_pool_mb": self.kv_pool / MIB,
            "num_blocks": self.num_blocks,
        }


def workspace_bytes(
    spec: ModelSpec,
    dtype: torch.dtype,
    max_tokens: int,
    max_seqs: int,
    max_model_len: int,
    graph_batch: int,
    measured_step: int | None = None,
    quantized_kv: bool = False,
    warm: bool = False,
    in_place_prefill: bool = False,
) -> int:
    """Largest transient footprint of one step, plus what CUDA graphs keep.

    `measured_step` is the peak the worst step allocated on the device (CUDA:
    model_runner.profile_step_peak, a full chunk at the end of max_model_len); without it the
    activations and sampler temporaries are counted tensor by tensor. `in_place_prefill`: the
    prefill kernel reads the paged cache in place (Triton on CUDA); else (the torch reference)
    a prefill gathers its keys at the query head count, and with `quantized_kv` (an int8 /
    int4 Hot-KV) first dequantizes them. `warm`: a Warm tier, whose prefix a prefill holds
    three times more at its own head count (the records copied to the device, decoded, and
    joined to the Hot keys).
    """
    e = dtype.itemsize
    h, v = spec.hidden_size, spec.vocab_size
    # The widest MLP a layer runs: dense, one routed expert's, or a shared expert's.
    dense = spec.intermediate_size if spec.moe_layer_count < spec.num_layers else 0
    i = max(dense, spec.expert_size, spec.shared_expert_intermediate_size)
    # Live at once inside a layer: x, residual, normed x, qkv, attention out, gate_up, act.
    per_token = (3 * h + spec.q_size + 2 * spec.kv_size + spec.q_size + 3 * i) * e
    # Logits in fp32 and up to three same-sized sampler temporaries (penalised, sorted, probs).
    step = max_tokens * per_token + max_seqs * v * 4 * 4
    if measured_step is not None:
        step = max(step, int(measured_step * 1.2))
    # The torch prefill gathers a long cached context's K/V contiguously (GQA heads
    # expanded, at most max_model_len keys) and may build a boolean mask of [chunk, keys].
    gather = 0
    if not in_place_prefill:
        gather = 2 * max_model_len * spec.q_size * e + max_tokens * max_model_len
    if quantized_kv and not in_place_prefill:  # dequantized first, at their own head count
        gather += 2 * max_model_len * spec.kv_size * e
    if warm:
        gather += 3 * 2 * max_model_len * spec.kv_size * e
    rope = 2 * max_model_len * spec.head_dim * 4
    graphs = 0
    if graph_batch:
        # Every captured size keeps its logits output, and a MoE model's every layer's MLP
        # input (a dense layer's output) and residual, and each MoE layer's router weights and
        # shared expert output (moe_graphs.py); the pool also holds one set of decode
        # activations; cuBLAS keeps a 32 MiB workspace for each of the (up to 3) streams used.
        kept = v * 4
        if spec.num_local_experts:
            shared = h * e if spec.shared_expert_intermediate_size else 0
            per_moe_layer = 4 * spec.num_experts_per_tok + shared
            kept += spec.num_layers * 2 * h * e + spec.moe_layer_count * per_moe_layer
        sizes = graph_sizes(graph_batch)
        graphs = sum(sizes) * kept + graph_batch * per_token * 2 + 3 * 32 * MIB
    return int((step + gather + rope) * 1.25 + graphs) + 64 * MIB


def plan_memory(
    weights: int,
    workspace: int,
    budget: int,
    block_size: int,
    block_bytes: int,
    min_tokens: int,
    num_blocks_override: int | None = None,
) -> MemoryPlan:
    """Give the KV pool what the budget leaves (or exactly `num_blocks_override` blocks, if
    they fit); it must hold at least `min_tokens` tokens. `block_bytes`: K and V of one block
    over all layers, in the Hot codec's layout."""
    free = budget - weights - workspace
    num_blocks = max(free // block_bytes, 0)
    if num_blocks_override is not None:
        if num_blocks_override > num_blocks:
            raise BudgetTooSmall(
                f"num_kv_blocks={num_blocks_override} does not fit: the budget "
                f"device_topology.gpu.memory_mb={budget // MIB} leaves room for {num_blocks}"
            )
        num_blocks = num_blocks_override
    need = -(-min_tokens // block_size)
    if num_blocks < need:
        raise BudgetTooSmall(
            f"device_topology.gpu.memory_mb={budget // MIB} is too small: weights take "
            f"{weights // MIB} MiB and the worst step's workspace {workspace // MIB} MiB, "
            f"leaving room for {num_blocks} KV blocks; one {min_tokens}-token sequence needs "
            f"{need}. Raise device_topology.gpu.memory_mb, or lower model.max_model_len or "
            "model.max_num_batched_tokens (the prefill chunk)."
        )
    return MemoryPlan(budget, weights, workspace, block_bytes, int(num_blocks), need)


def spare_expert_slots(plan: MemoryPlan, fixed_pool: bool, expert_bytes: int) -> int:
    """For cold_weights.expert_cache_slots: auto, the experts that fit beside a plan: the KV
    pool keeps its size if fixed (kv_cache.hot_region_mb), else its minimum, and what the
    budget leaves beyond it and the plan's weights, workspace holds that many more."""
    free = plan.budget - plan.weights - plan.workspace
    kv = plan.kv_pool if fixed_pool else plan.min_blocks * plan.block_bytes
    return max(free - kv, 0) // expert_bytes


CPU_BUDGET_MB = 4096
"""The CPU engine's budget when device_topology.gpu.memory_mb is unset."""


def budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """device_topology.gpu.memory_mb, or 90 % of the device's free memory. On the CPU (default
    CPU_BUDGET_MB) the budget is host memory, so it is capped at the host tiers' share of what
    is available: a larger one could not be allocated (the Hot pool fills the budget)."""
    if device.type == "cuda":
        if config.gpu_memory_mb is not None:
            return config.gpu_memory_mb * MIB
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9) + torch.cuda.memory_reserved(device)
    from hybridgen.engine.host_memory import AVAILABLE_SHARE, available_bytes  # imports us

    asked = (config.gpu_memory_mb or CPU_BUDGET_MB) * MIB
    available = available_bytes()
    if available is None or asked <= available * AVAILABLE_SHARE:
        return asked
    capped = int(available * AVAILABLE_SHARE)
    log.info(
        "cpu_budget_capped",
        asked_mb=asked // MIB,
        available_mb=available // MIB,
        budget_mb=capped // MIB,
    )
    return capped


def graph_batch_size(config: EngineConfig, model: CausalLM) -> int:
    """Largest decode batch captured in CUDA graphs (a MoE model's piecewise, between the
    layers' expert picks: moe_graphs.py); 0: none, also when layers live in host memory
    (weights.gpu_layers): their host calls and weight copies cannot be captured, so decode
    runs eager; and with tensor_parallel > 1 (eager only, for now)."""
    if not config.cuda_graphs or model.host_layers is not None or config.tensor_parallel > 1:
        return 0
    return min(config.max_graph_batch, config.max_num_seqs)


def block_bytes(config: EngineConfig, spec: ModelSpec) -> int:
    """K and V of one block over all layers, in the Hot codec's layout."""
    per_layer = hot_kv_bytes_per_token(
        config.hot_codec, spec.num_kv_heads, spec.head_dim, spec.dtype
    )
    return per_layer * spec.kv_copies // 2 * spec.num_layers * config.block_size


def weights_bytes(model: CausalLM) -> int:
    """The model's device weights: its parameters, plus Cold-Weights' expert cache (the
    experts themselves are host memory, no parameters). Host layers' projections
    (weights.gpu_layers) are no parameters either: their two staging slots count."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.host_layers is not None:
        weights += model.host_layers.staging_bytes
    caches = {
        id(m.cold[1]): m.cold[1].nbytes
        for m in model.modules()
        if isinstance(m, SparseMoeBlock) and m.cold is not None
    }
    return weights + sum(caches.values())


def plan_engine_memory(
    config: EngineConfig,
    model: CausalLM,
    device: torch.device,
    held: int = 0,
    offloaded: int = 0,
) -> tuple[MemoryPlan, int]:
    """The engine's plan and max_model_len: the longest context the budget allows (or an
    error naming what to change). `held`: device bytes the engine's allocator holds now
    (CUDA: reserved, its cache emptied), counted as weights when above their parameters'
    bytes: loading can leave segments pinned by small tensors carved from them (int4
    weights quantized on the device), memory the KV pool cannot have. `offloaded`: bytes of
    the model's parameters that will leave the device (host layers, weights.gpu_layers:
    auto sizes them); host layers already offloaded are no parameters of the model."""
    c, spec = config, model.spec
    length = c.max_model_len or model_max_len(spec.rope, spec.max_position_embeddings)
    blocks = c.num_kv_blocks
    kv_block = block_bytes(c, spec)
    if blocks is None and c.kv_pool_mb is not None:
        blocks = max(1, int(c.kv_pool_mb * MIB) // kv_block)
    if blocks is not None and c.max_model_len is None and not c.warm_extends_hot:
        length = min(length, blocks * c.block_size)
    weights = max(weights_bytes(model) - offloaded, held)
    budget = budget_bytes(c, device)
    measured, graphs = None, 0
    in_place = device.type == "cuda" and ops.HAS_TRITON
    if device.type == "cuda":
        # The worst step at the configured limits: a full chunk attending max_model_len keys.
        chunk, seqs = c.max_num_batched_tokens, c.max_num_seqs
        measured = profile_step_peak(model, chunk, seqs, c.block_size, device, length, c.hot_codec)
        graphs = graph_batch_size(c, model)

    def work(length: int, warm: bool) -> int:
        return workspace_bytes(
            spec,
            spec.dtype,
            c.max_num_batched_tokens,
            c.max_num_seqs,
            length,
            graphs,
            measured,
            c.hot_codec != "native",
            warm,
            in_place,
        )

    while True:
        # Hot must hold a whole sequence, or with a Warm tier one step's chunk and a block
        # for each running sequence (the rest of their KV can move to Warm; not with
        # spill_policy never).
        hot_tokens = length
        if c.warm_extends_hot:
            hot_tokens = min(length, c.max_num_batched_tokens + c.max_num_seqs * c.block_size)
        try:
            # A prefill reads a Warm prefix in place only for a sequence too long for Hot
            # alone (any other loads its prefix back first: scheduler.py). The room for that
            # read is planned only when Hot without it cannot hold max_model_len.
            plan = plan_memory(
                weights, work(length, False), budget, c.block_size, kv_block, hot_tokens, blocks
            )
            if c.warm_extends_hot and plan.num_blocks * c.block_size < length:
                plan = plan_memory(
                    weights, work(length, True), budget, c.block_size, kv_block, hot_tokens, blocks
                )
            return plan, length
        except BudgetTooSmall:
            if c.max_model_len is not None or length <= 256 or c.warm_extends_hot:
                raise
            length //= 2
            log.warning(
                "max_model_len_reduced",
                max_model_len=length,
                reason="KV pool too small for the model's full context",
            )


STAGING_SLOTS = 2
"""Device copies of one host layer (models/host_layers.py: double-buffered)."""
RESIDENT_SLACK = 0.02
"""weights.gpu_layers: auto counts each resident layer this much larger than its bytes: the
layers moved back to the device leave the allocator holding more than their parameters
(the final plan counts what it holds), and auto sized without it came out 37 MiB of KV short
on the H200 (llama3-70b int4, 24 GB: 121 of the 128 blocks max_model_len needs)."""


def auto_gpu_layers(
    config: EngineConfig,
    model: CausalLM,
    device: torch.device,
    layer_bytes: int,
    hosted: int = 0,
) -> int:
    """weights.gpu_layers: auto: the most decoder layers that can stay on the device while the
    plan keeps the max_model_len it has with every layer's projections (`layer_bytes` each)
    in host memory but the two staging slots; every layer when the whole model fits so.
    `hosted`: layers the model holds in host memory now (its staging slots counted). Each
    resident layer is counted RESIDENT_SLACK larger than its bytes (module constant)."""
    n = model.spec.num_layers

    def length(resident: int) -> int | None:
        staging = STAGING_SLOTS * ((hosted > 0) - (resident < n))
        slack = int(RESIDENT_SLACK * resident * layer_bytes)
        offloaded = (n - hosted - resident + staging) * layer_bytes - slack
        try:
            return plan_engine_memory(config, model, device, 0, offloaded)[1]
        except BudgetTooSmall:
            return None

    target = length(0)
    if target is None:
        raise BudgetTooSmall(
            f"weights.gpu_layers=auto: the budget device_topology.gpu.memory_mb="
            f"{budget_bytes(config, device) // MIB} cannot hold the model even with every "
            "decoder layer in host memory; raise it or lower model.max_model_len"
        )
    lo, hi = 0, n  # length(lo) == target; find the largest such
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length(mid) == target:
            lo = mid
        else:
            hi = mid - 1
    return lo
