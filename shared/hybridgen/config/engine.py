"""Typed configuration of the model engine (the GPU daemon's core)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hybridgen.config.ranges import CHOICES, RANGES

if TYPE_CHECKING:  # both import the kernels, a second on the CPU: not for a config
    import torch

    from hybridgen.experts.format import Format
    from hybridgen.models.dense_quant import WeightFormat


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the key."""


def _check(ok: bool, key: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is out of range: allowed {allowed}")


def _either(choices: tuple[object, ...]) -> str:
    """Choices in words: "native, int8 or int4"."""
    *first, last = (str(c) for c in choices)
    return f"{', '.join(first)} or {last}" if first else last


@dataclass(frozen=True)
class EngineConfig:
    """How to load and run one model."""

    model: str = "tiny-llama"
    """A checkpoint directory or a synthetic preset name."""
    device: str = "auto"
    """auto (cuda if present, else cpu), cpu, cuda or cuda:N."""
    dtype: str = "auto"
    """auto (checkpoint dtype; presets: bfloat16 on GPU, float32 on CPU) or a dtype name."""
    gpu_memory_mb: int | None = None
    """Hard budget for everything the engine allocates (device_topology.gpu.memory_mb);
    None: 90 % of the device's free memory (on CPU: 4096)."""
    cpu_bandwidth_gbps: float | None = None
    """Host memory bandwidth (device_topology.cpu.bandwidth_gbps): the CPU's time to read an
    expert's weights in the Cold-Weights latency model; None: measured at start."""
    gpu_bandwidth_gbps: float | None = None
    """Device memory bandwidth (device_topology.gpu.bandwidth_gbps): the device's time for a
    fetched expert in the latency model; None: measured at start."""
    host_memory_mb: int | None = None
    """Host memory budget for the Warm and Cold tiers and Cold-Weights' experts
    (device_topology.cpu.memory_mb); None: 90 % of the host's available memory."""
    block_size: int = 16
    """Tokens per KV block."""
    max_num_seqs: int = 64
    """Sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Tokens per step; longer prompts are prefilled in chunks."""
    step_latency_ms: float = 25.0
    """Longest a step with decodes should take (model.step_latency_ms): the prefill beside
    them is sized from measured step times (engine/step_budget.py); where the host's launch
    of such a step takes longer, the step takes that, filled with prefill. 0: no limit."""
    num_kv_blocks: int | None = None
    """Use exactly this many KV blocks instead of all the budget leaves (must still fit)."""
    kv_pool_mb: float | None = None
    """Size the KV pool to this many MiB instead of all the budget leaves (kv_cache.
    hot_region_mb; must still fit); ignored when num_kv_blocks is set."""
    max_model_len: int | None = None
    """Longest sequence; None: the model's, capped by what the KV pool can hold."""
    hot_codec: Literal["native", "int8", "int4"] = "native"
    """Hot-KV storage (kv_cache.hot_codec): native (the model dtype), int8 or int4, both
    group-quantized per token and dequantized inside the attention kernel."""
    warm_pool_mb: float = 0.0
    """Host memory (MiB) for the Warm tier (kv_cache.warm_region_mb): Hot blocks move there
    when the Hot pool runs short or their sequence is preempted. 0: no Warm tier."""
    warm_codec: str = "int8"
    """Warm-KV codec (kv_cache.warm_codec): lossless, lz4, int8 or int4."""
    attn_warm: str = "auto"
    """Where attention over Warm blocks runs (placements.attn_warm): cpu (mode a), gpu (mode
    b: compressed blocks cross PCIe, the device decodes), split (mode c), or auto: measured
    at start (CUDA; the CPU on a CPU-only engine)."""
    cold_threshold_ms: float = 150.0
    """A cached Warm block unused this long moves to Cold (kv_cache.cold_threshold_ms)."""
    hot_turn_tokens: int = 0
    """With a Warm tier, time slicing (kv_cache.hot_turn_tokens): when the first waiting
    sequence fits Hot alone but not beside the running ones, a running one that generated
    this many tokens since it came in swaps to Warm and queues again, so sequences take turns
    in Hot instead of one waiting for another to finish. 0: first come, first served."""
    spill_policy: str = "auto"
    """With a Warm tier (kv_cache.spill_policy), what a waiting sequence that fits Hot alone
    but not beside the running ones does: auto (wait, swap others out, take turns or spill
    to Warm, whichever measured costs predict finishes the affected requests soonest),
    always (wait or take turns; spill only what cannot fit Hot alone) or never (never spill:
    Hot must hold max_model_len, as in pure_gpu)."""
    warm_draft_tokens: int = 0
    """With a Warm tier, self-speculative decoding (kv_cache.warm_draft_tokens): a decode batch
    holding Warm keys first drafts this many tokens attending Hot alone, then checks them in
    one step over Hot and Warm, which keeps every token the sampler picks from the exact
    logits, so Warm is read once for up to this many + 1 tokens. 0: off."""
    warm_split: float | None = None
    """With attn_warm split: the share of each sequence's Warm blocks the CPU attends; None:
    measured at start, so that both sides finish together."""
    shm_instance: str | None = None
    cpu_expert_threads: int | None = None
    """Threads of the process that computes the CPU's experts when it is not this one (the CPU
    daemon's torch pool, affinity.cpu_daemon_cores): the latency model times the CPU at this
    count; None: this process's pool, which computes them."""
    """Server instance to name the engine's shared memory (the Warm pool) after, so that the
    daemon's cleanup removes it even after a crash; None: a private name (in-process use)."""
    prefix_reuse: bool = True
    """Keep computed KV blocks cached by prefix hash and reuse them for new requests."""
    cuda_graphs: bool = True
    """Replay decode steps from CUDA graphs (CUDA only)."""
    max_graph_batch: int = 64
    """Largest decode batch captured in a graph; larger batches run eagerly."""
    decode_steps: int = 4
    """Decode steps run back to back on the device between host syncs while every running
    sequence decodes without penalties: tokens then stream in groups of this size, and up
    to decode_steps - 1 tokens past a stop are computed and dropped. 1 syncs every token."""
    sample_placement: str = "gpu"
    """Where tokens are picked: gpu (the device sampler), or cpu (the GPU sends each row's
    top num_candidates logits and the CPU picks; requests with penalties stay on the GPU)."""
    num_candidates: int = 64
    """Logits per row sent to the CPU when sample_placement is cpu."""
    seed: int = 0
    """Seed of synthetic preset weights."""
    kv_codec_placement: str = "gpu"
    """Where the Warm codec encodes spilled blocks and decodes copied records
    (placements.kv_codec): gpu (compressed bytes cross PCIe) or cpu (raw bytes cross)."""
    moe_gate_placement: str = "gpu"
    """Where MoE routers pick experts (placements.moe_gate): gpu (softmax and top-k on the
    device) or cpu (the router's logits to the host, the pick there)."""
    measure_regions: bool | None = None
    """Time sample, kv_codec and moe_gate both ways at start and place each on the faster
    side, where neither the config nor a profile placed it (placement/region_timing.py).
    None: on CUDA only (on a CPU-only engine both sides are the CPU); never in pure_gpu."""
    dynamic_tuning: bool = False
    """Re-balance attn_warm's split from live timings while serving (placement/tuner.py;
    dynamic_tuning.enable in the config file)."""
    tuning_warmup_steps: int = 32
    """Engine steps before the first re-balance."""
    tuning_interval_ms: int = 500
    """Time between re-balances."""
    degrade_softmax: str = "auto"
    """Where the degrade path moves the sampler's softmax and pick (placements.softmax): cpu,
    gpu (sampling stays on the device under backpressure), or auto: cpu while its work per
    step is below softmax_threshold_mflops."""
    softmax_threshold_mflops: float = 12000.0
    """offload_threshold.softmax: a degrade-path softmax of this much work per step or more
    stays on the GPU."""
    pinned_regions: tuple[str, ...] = ()
    """Regions whose placement the config pinned (placements.*); the region table says so."""
    profiled_regions: tuple[str, ...] = ()
    """Regions placed by the tuning profile (config profile_path); the region table says so."""
    profile_measured: tuple[tuple[str, str, float], ...] = ()
    """The profile's figures behind those placements: (region, key, value), e.g.
    ("sample", "cpu_ms", 0.12); the region table shows them."""
    expert_cache_slots: int | Literal["auto"] | None = None
    """Cold-Weights for MoE models: None keeps every expert on the device; N keeps the experts
    in host memory with an N-expert device cache (LRU, shared by all layers)."""
    weights_format: WeightFormat = "native"
    """Dense projections (weights.format): native (the model dtype), or int8 / int4 weight-only,
    quantized at load (a GGUF's Q8_0 / Q4_0 / Q4_1 repacked) and multiplied by fused
    dequantizing kernels (models/dense_quant.py)."""
    gpu_layers: int | Literal["auto"] | None = None
    """Decoder layers resident on the device (weights.gpu_layers): the first N, the rest in
    host memory (models/host_layers.py); auto: the most the budget holds; None: all."""
    host_layer_compute: Literal["auto", "cpu", "stream", "split"] = "auto"
    """How a step computes host layers (weights.host_layer_compute): cpu, stream, split (rows
    on both at once), or auto (by the latency model, per step)."""
    expert_format: Format = "native"
    """Cold-Weights: the experts' stored format, native, int8 or int4 (experts/format.py);
    int8 and int4 need expert_cache_slots."""
    expert_cpu_max_tokens: int | None = None
    """Cold-Weights: an uncached expert with at most this many routed tokens runs on the CPU,
    more are fetched into the cache; None: the crossover of the latency model timed at start."""
    tensor_parallel: int = 1
    """Ranks the model is split over (device_topology.gpu.tensor_parallel), one per device:
    this process is rank 0, the others are worker processes (hybridgen/parallel)."""
    tensor_parallel_ids: tuple[int, ...] | None = None
    """CUDA device of each rank (device_topology.gpu.ids); None: 0..tensor_parallel-1."""
    mode: str = "hybrid"
    """The config's top-level mode, which GetModelInfo reports: hybrid, or pure_gpu (no
    Warm tier and sampling on the device: the CPU only detokenizes and streams)."""

    def __post_init__(self) -> None:
        for ranged in RANGES.values():  # the file's ranges (config/ranges.py), by field name
            value = getattr(self, ranged.field)
            allowed = ranged.range
            _check(value is None or allowed.allows(value), ranged.field, value, allowed.allowed)
        for chosen in CHOICES.values():
            value = getattr(self, chosen.field)
            _check(value in chosen.choices, chosen.field, value, _either(chosen.choices))
        _check(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            self.device,
            "auto, cpu, cuda or cuda:N",
        )
        _check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            f">= max_num_seqs ({self.max_num_seqs})",
        )
        _check(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            "num_kv_blocks",
            self.num_kv_blocks,
            ">= 1",
        )
        _check(1 <= self.num_candidates <= 1024, "num_candidates", self.num_candidates, "1..1024")
        if self.warm_split is not None:
            _check(0.0 <= self.warm_split <= 1.0, "warm_split", self.warm_split, "0..1")
        _check(1 <= self.decode_steps <= 16, "decode_steps", self.decode_steps, "1..16")
        _check(1 <= self.max_graph_batch <= 512, "max_graph_batch", self.max_graph_batch, "1..512")
        self._check_combinations()
        self._check_tensor_parallel()

    def _check_combinations(self) -> None:
        """Values allowed alone that do not go together."""
        _check(
            self.warm_pool_mb == 0 or self.hot_codec in ("native", self.warm_codec),
            "warm_codec",
            self.warm_codec,
            f"{self.hot_codec} with hot_codec: {self.hot_codec} (a quantized Hot cache moves "
            "its blocks to Warm as they are)",
        )
        if self.mode == "pure_gpu":
            _check(
                self.warm_pool_mb == 0, "warm_pool_mb", self.warm_pool_mb, "0 with mode=pure_gpu"
            )
            _check(
                self.sample_placement == "gpu",
                "sample_placement",
                self.sample_placement,
                "gpu with mode=pure_gpu",
            )
        _check(
            self.expert_format == "native" or self.expert_cache_slots is not None,
            "expert_format",
            self.expert_format,
            "native, or int8 / int4 with expert_cache_slots set",
        )

    def _check_tensor_parallel(self) -> None:
        """tensor_parallel's ids, and what it does not combine with (yet)."""
        tp = self.tensor_parallel
        ids = self.tensor_parallel_ids
        _check(
            ids is None or (len(ids) == tp and len(set(ids)) == tp and min(ids) >= 0),
            "tensor_parallel_ids",
            ids,
            f"{tp} distinct device ids >= 0 (one per rank), or unset",
        )
        if tp == 1:
            return
        for key, value, allowed in (
            ("warm_pool_mb", self.warm_pool_mb, 0),
            ("gpu_layers", self.gpu_layers, None),
            ("expert_cache_slots", self.expert_cache_slots, None),
            ("weights_format", self.weights_format, "native"),
            ("hot_codec", self.hot_codec, "native"),
        ):
            _check(value == allowed, key, value, f"{allowed!r} with tensor_parallel > 1")

    @property
    def warm_extends_hot(self) -> bool:
        """A Warm tier that running sequences may spill into, so that Hot need not hold a
        whole sequence (spill_policy never: it must)."""
        return self.warm_pool_mb > 0 and self.spill_policy != "never"

    def torch_device(self) -> torch.device:
        import torch

        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return None if self.dtype == "auto" else getattr(torch, self.dtype)
