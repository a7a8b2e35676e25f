from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "max_tokens", "sampling", "stop", "stop_token_ids", "ignore_eos", "add_special_tokens", "messages", "add_generation_prompt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    add_special_tokens: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class StreamGenerateRequest(_message.Message):
    __slots__ = ("start", "chunk")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    start: GenerateRequest
    chunk: PromptChunk
    def __init__(self, start: _Optional[_Union[GenerateRequest, _Mapping]] = ..., chunk: _Optional[_Union[PromptChunk, _Mapping]] = ...) -> None: ...

class PromptChunk(_message.Message):
    __slots__ = ("text", "token_ids", "last")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    last: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., last: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: Logprobs
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens", "messages", "add_generation_prompt")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "synthetic", "vocab_size", "max_model_len", "dtype", "device", "kv_block_size", "kv_blocks_total", "kv_blocks_used", "max_num_seqs", "running_requests", "queued_requests", "max_queue", "family", "eos_token_ids", "ring_occupancy_c2g", "ring_occupancy_g2c", "gpu_heartbeat_jitter_p99_ms", "cpu_heartbeat_jitter_p99_ms", "gpu_backpressure", "prefix_cached_tokens", "warm_blocks_total", "warm_blocks_used", "hot_hit_rate", "warm_decompress_p50_ms", "warm_decompress_p95_ms", "cpu_attention_ms", "pcie_h2d_bytes", "pcie_d2h_bytes", "mode", "gpu_mem_peak_reserved_mb", "op_regions", "degraded", "degrade_entries", "degraded_steps", "expert_cache_hit_rate", "cpu_experts", "cpu_daemon_experts", "gpu_experts", "expert_bytes_h2d", "warm_drafted_tokens", "warm_accepted_drafts", "spill_policy", "spill_decisions_wait", "spill_decisions_swap", "spill_decisions_turns", "spill_decisions_spill", "spill_last_choice", "spill_predicted_wait_s", "spill_predicted_swap_s", "spill_predicted_turns_s", "spill_predicted_spill_s", "spill_decode_step_ms", "spill_prefill_ms", "spill_warm_step_ms", "spill_warm_block_us", "spill_move_block_us", "prefix_hot_hits", "prefix_warm_hits", "prefix_cold_hits", "prefix_hot_tokens", "prefix_warm_tokens", "prefix_cold_tokens", "warm_kept_blocks", "warm_keep_skipped", "cold_blocks", "gpu_layers", "host_layers", "host_layer_compute", "host_layer_bytes", "cpu_layer_steps", "streamed_layer_steps", "host_bytes_per_token", "split_layer_steps", "host_split_fraction", "host_cpu_ms_per_token", "decode_step_ms", "host_layer_max_tokens", "mixed_step_ms", "eager_launch_ms", "warm_keep_failed", "step_s_schedule", "step_s_decode", "step_s_prefill", "step_s_warm", "step_s_outputs", "warm_keep_recomputed", "step_n_decode", "step_n_prefill", "step_n_warm", "step_rows_decode", "step_rows_prefill", "step_rows_warm", "step_tokens_prefill", "step_tokens_warm")
    class DecodeStepMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class MixedStepMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RING_OCCUPANCY_C2G_FIELD_NUMBER: _ClassVar[int]
    RING_OCCUPANCY_G2C_FIELD_NUMBER: _ClassVar[int]
    GPU_HEARTBEAT_JITTER_P99_MS_FIELD_NUMBER: _ClassVar[int]
    CPU_HEARTBEAT_JITTER_P99_MS_FIELD_NUMBER: _ClassVar[int]
    GPU_BACKPRESSURE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WARM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    HOT_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    WARM_DECOMPRESS_P50_MS_FIELD_NUMBER: _ClassVar[int]
    WARM_DECOMPRESS_P95_MS_FIELD_NUMBER: _ClassVar[int]
    CPU_ATTENTION_MS_FIELD_NUMBER: _ClassVar[int]
    PCIE_H2D_BYTES_FIELD_NUMBER: _ClassVar[int]
    PCIE_D2H_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    GPU_MEM_PEAK_RESERVED_MB_FIELD_NUMBER: _ClassVar[int]
    OP_REGIONS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_STEPS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    CPU_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    CPU_DAEMON_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    GPU_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_H2D_FIELD_NUMBER: _ClassVar[int]
    WARM_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARM_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPILL_POLICY_FIELD_NUMBER: _ClassVar[int]
    SPILL_DECISIONS_WAIT_FIELD_NUMBER: _ClassVar[int]
    SPILL_DECISIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    SPILL_DECISIONS_TURNS_FIELD_NUMBER: _ClassVar[int]
    SPILL_DECISIONS_SPILL_FIELD_NUMBER: _ClassVar[int]
    SPILL_LAST_CHOICE_FIELD_NUMBER: _ClassVar[int]
    SPILL_PREDICTED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SPILL_PREDICTED_SWAP_S_FIELD_NUMBER: _ClassVar[int]
    SPILL_PREDICTED_TURNS_S_FIELD_NUMBER: _ClassVar[int]
    SPILL_PREDICTED_SPILL_S_FIELD_NUMBER: _ClassVar[int]
    SPILL_DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    SPILL_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    SPILL_WARM_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    SPILL_WARM_BLOCK_US_FIELD_NUMBER: _ClassVar[int]
    SPILL_MOVE_BLOCK_US_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOT_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_WARM_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_COLD_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_WARM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_COLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARM_KEPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WARM_KEEP_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    COLD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HOST_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HOST_LAYER_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    HOST_LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_LAYER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STREAMED_LAYER_STEPS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYER_STEPS_FIELD_NUMBER: _ClassVar[int]
    HOST_SPLIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    HOST_CPU_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    HOST_LAYER_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIXED_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    EAGER_LAUNCH_MS_FIELD_NUMBER: _ClassVar[int]
    WARM_KEEP_FAILED_FIELD_NUMBER: _ClassVar[int]
    STEP_S_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    STEP_S_DECODE_FIELD_NUMBER: _ClassVar[int]
    STEP_S_PREFILL_FIELD_NUMBER: _ClassVar[int]
    STEP_S_WARM_FIELD_NUMBER: _ClassVar[int]
    STEP_S_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    WARM_KEEP_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    STEP_N_DECODE_FIELD_NUMBER: _ClassVar[int]
    STEP_N_PREFILL_FIELD_NUMBER: _ClassVar[int]
    STEP_N_WARM_FIELD_NUMBER: _ClassVar[int]
    STEP_ROWS_DECODE_FIELD_NUMBER: _ClassVar[int]
    STEP_ROWS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    STEP_ROWS_WARM_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_WARM_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    synthetic: bool
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    kv_block_size: int
    kv_blocks_total: int
    kv_blocks_used: int
    max_num_seqs: int
    running_requests: int
    queued_requests: int
    max_queue: int
    family: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ring_occupancy_c2g: float
    ring_occupancy_g2c: float
    gpu_heartbeat_jitter_p99_ms: float
    cpu_heartbeat_jitter_p99_ms: float
    gpu_backpressure: int
    prefix_cached_tokens: int
    warm_blocks_total: int
    warm_blocks_used: int
    hot_hit_rate: float
    warm_decompress_p50_ms: float
    warm_decompress_p95_ms: float
    cpu_attention_ms: float
    pcie_h2d_bytes: int
    pcie_d2h_bytes: int
    mode: str
    gpu_mem_peak_reserved_mb: float
    op_regions: _containers.RepeatedCompositeFieldContainer[OpRegion]
    degraded: bool
    degrade_entries: int
    degraded_steps: int
    expert_cache_hit_rate: float
    cpu_experts: int
    cpu_daemon_experts: int
    gpu_experts: int
    expert_bytes_h2d: int
    warm_drafted_tokens: int
    warm_accepted_drafts: int
    spill_policy: str
    spill_decisions_wait: int
    spill_decisions_swap: int
    spill_decisions_turns: int
    spill_decisions_spill: int
    spill_last_choice: str
    spill_predicted_wait_s: float
    spill_predicted_swap_s: float
    spill_predicted_turns_s: float
    spill_predicted_spill_s: float
    spill_decode_step_ms: float
    spill_prefill_ms: float
    spill_warm_step_ms: float
    spill_warm_block_us: float
    spill_move_block_us: float
    prefix_hot_hits: int
    prefix_warm_hits: int
    prefix_cold_hits: int
    prefix_hot_tokens: int
    prefix_warm_tokens: int
    prefix_cold_tokens: int
    warm_kept_blocks: int
    warm_keep_skipped: int
    cold_blocks: int
    gpu_layers: int
    host_layers: int
    host_layer_compute: str
    host_layer_bytes: int
    cpu_layer_steps: int
    streamed_layer_steps: int
    host_bytes_per_token: float
    split_layer_steps: int
    host_split_fraction: float
    host_cpu_ms_per_token: float
    decode_step_ms: _containers.ScalarMap[int, float]
    host_layer_max_tokens: int
    mixed_step_ms: _containers.ScalarMap[int, float]
    eager_launch_ms: float
    warm_keep_failed: int
    step_s_schedule: float
    step_s_decode: float
    step_s_prefill: float
    step_s_warm: float
    step_s_outputs: float
    warm_keep_recomputed: int
    step_n_decode: int
    step_n_prefill: int
    step_n_warm: int
    step_rows_decode: int
    step_rows_prefill: int
    step_rows_warm: int
    step_tokens_prefill: int
    step_tokens_warm: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., synthetic: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., max_queue: _Optional[int] = ..., family: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., ring_occupancy_c2g: _Optional[float] = ..., ring_occupancy_g2c: _Optional[float] = ..., gpu_heartbeat_jitter_p99_ms: _Optional[float] = ..., cpu_heartbeat_jitter_p99_ms: _Optional[float] = ..., gpu_backpressure: _Optional[int] = ..., prefix_cached_tokens: _Optional[int] = ..., warm_blocks_total: _Optional[int] = ..., warm_blocks_used: _Optional[int] = ..., hot_hit_rate: _Optional[float] = ..., warm_decompress_p50_ms: _Optional[float] = ..., warm_decompress_p95_ms: _Optional[float] = ..., cpu_attention_ms: _Optional[float] = ..., pcie_h2d_bytes: _Optional[int] = ..., pcie_d2h_bytes: _Optional[int] = ..., mode: _Optional[str] = ..., gpu_mem_peak_reserved_mb: _Optional[float] = ..., op_regions: _Optional[_Iterable[_Union[OpRegion, _Mapping]]] = ..., degraded: _Optional[bool] = ..., degrade_entries: _Optional[int] = ..., degraded_steps: _Optional[int] = ..., expert_cache_hit_rate: _Optional[float] = ..., cpu_experts: _Optional[int] = ..., cpu_daemon_experts: _Optional[int] = ..., gpu_experts: _Optional[int] = ..., expert_bytes_h2d: _Optional[int] = ..., warm_drafted_tokens: _Optional[int] = ..., warm_accepted_drafts: _Optional[int] = ..., spill_policy: _Optional[str] = ..., spill_decisions_wait: _Optional[int] = ..., spill_decisions_swap: _Optional[int] = ..., spill_decisions_turns: _Optional[int] = ..., spill_decisions_spill: _Optional[int] = ..., spill_last_choice: _Optional[str] = ..., spill_predicted_wait_s: _Optional[float] = ..., spill_predicted_swap_s: _Optional[float] = ..., spill_predicted_turns_s: _Optional[float] = ..., spill_predicted_spill_s: _Optional[float] = ..., spill_decode_step_ms: _Optional[float] = ..., spill_prefill_ms: _Optional[float] = ..., spill_warm_step_ms: _Optional[float] = ..., spill_warm_block_us: _Optional[float] = ..., spill_move_block_us: _Optional[float] = ..., prefix_hot_hits: _Optional[int] = ..., prefix_warm_hits: _Optional[int] = ..., prefix_cold_hits: _Optional[int] = ..., prefix_hot_tokens: _Optional[int] = ..., prefix_warm_tokens: _Optional[int] = ..., prefix_cold_tokens: _Optional[int] = ..., warm_kept_blocks: _Optional[int] = ..., warm_keep_skipped: _Optional[int] = ..., cold_blocks: _Optional[int] = ..., gpu_layers: _Optional[int] = ..., host_layers: _Optional[int] = ..., host_layer_compute: _Optional[str] = ..., host_layer_bytes: _Optional[int] = ..., cpu_layer_steps: _Optional[int] = ..., streamed_layer_steps: _Optional[int] = ..., host_bytes_per_token: _Optional[float] = ..., split_layer_steps: _Optional[int] = ..., host_split_fraction: _Optional[float] = ..., host_cpu_ms_per_token: _Optional[float] = ..., decode_step_ms: _Optional[_Mapping[int, float]] = ..., host_layer_max_tokens: _Optional[int] = ..., mixed_step_ms: _Optional[_Mapping[int, float]] = ..., eager_launch_ms: _Optional[float] = ..., warm_keep_failed: _Optional[int] = ..., step_s_schedule: _Optional[float] = ..., step_s_decode: _Optional[float] = ..., step_s_prefill: _Optional[float] = ..., step_s_warm: _Optional[float] = ..., step_s_outputs: _Optional[float] = ..., warm_keep_recomputed: _Optional[int] = ..., step_n_decode: _Optional[int] = ..., step_n_prefill: _Optional[int] = ..., step_n_warm: _Optional[int] = ..., step_rows_decode: _Optional[int] = ..., step_rows_prefill: _Optional[int] = ..., step_rows_warm: _Optional[int] = ..., step_tokens_prefill: _Optional[int] = ..., step_tokens_warm: _Optional[int] = ...) -> None: ...

class OpRegion(_message.Message):
    __slots__ = ("name", "scope", "label", "placement", "source", "measured")
    class MeasuredEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    name: str
    scope: str
    label: str
    placement: str
    source: str
    measured: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., scope: _Optional[str] = ..., label: _Optional[str] = ..., placement: _Optional[str] = ..., source: _Optional[str] = ..., measured: _Optional[_Mapping[str, float]] = ...) -> None: ...
