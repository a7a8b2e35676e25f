"""HF transformers on the same shapes and weights as our engine: the benchmark's anchor."""

from __future__ import annotations

import statistics
import time
from typing import Any

import structlog
import torch

from hybridgen.models.spec import ModelSpec

log = structlog.get_logger()


def hf_config(spec: ModelSpec) -> Any:
    """A transformers config with the spec's shape (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE,
    Qwen3-MoE or DeepSeek-V2)."""
    import transformers

    rope: dict[str, Any] = {"rope_type": spec.rope.rope_type, "rope_theta": spec.rope.theta}
    if spec.rope.rope_type == "llama3":
        rope.update(
            factor=spec.rope.factor,
            low_freq_factor=spec.rope.low_freq_factor,
            high_freq_factor=spec.rope.high_freq_factor,
            original_max_position_embeddings=spec.rope.original_max_position,
        )
    if spec.rope.rope_type == "yarn":
        rope.update(
            factor=spec.rope.factor,
            original_max_position_embeddings=spec.rope.original_max_position,
            beta_fast=spec.rope.beta_fast,
            beta_slow=spec.rope.beta_slow,
            mscale=spec.rope.mscale,
            mscale_all_dim=spec.rope.mscale_all_dim,
        )
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
    }[spec.family]
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters=rope,
    )
    if spec.family in ("mistral", "mixtral"):
        kwargs["sliding_window"] = spec.sliding_window or None
    if spec.family == "mixtral":
        kwargs.update(
            num_local_experts=spec.num_local_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
        )
    if spec.family in ("qwen2_moe", "qwen3_moe"):
        kwargs.update(
            num_experts=spec.num_local_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.expert_size,
            norm_topk_prob=spec.norm_topk_prob,
            mlp_only_layers=list(spec.dense_layers),
        )
    if spec.family == "qwen2_moe":
        kwargs.update(
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
            qkv_bias=spec.attention_bias,
        )
    if spec.mla is not None:
        kwargs.update(_deepseek_kwargs(spec))
    return cls(**kwargs)


def _deepseek_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """DeepseekV2Config's MLA, routing and expert fields for the spec."""
    assert spec.mla is not None
    m = spec.mla
    grouped = spec.topk_groups < spec.expert_groups
    return dict(
        num_key_value_heads=spec.num_heads,  # HF expands the latent to every head
        head_dim=m.qk_rope_head_dim,
        q_lora_rank=m.q_lora_rank or None,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        n_routed_experts=spec.num_local_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.expert_size,
        n_shared_experts=spec.shared_expert_intermediate_size // spec.expert_size,
        topk_method="group_limited_greedy" if grouped else "greedy",
        n_group=spec.expert_groups,
        topk_group=spec.topk_groups,
        routed_scaling_factor=spec.routed_scaling_factor,
        first_k_dense_replace=len(spec.dense_layers),
        norm_topk_prob=False,
    )


class HFBaseline:
    """A transformers model holding the given HF-named weights, in their dtype."""

    def __init__(
        self, spec: ModelSpec, weights: dict[str, torch.Tensor], device: torch.device
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=spec.dtype)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
        if spec.tie_word_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"HF model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        self.model = model.eval()

    @torch.inference_mode()
    def _generate(self, ids: torch.Tensor, n: int) -> float:
        from transformers import GenerationConfig

        cfg = GenerationConfig(
            do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0
        )
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        sync()
        return time.perf_counter() - t0

    def timed(self, prompts: list[list[int]], new_tokens: int, runs: int) -> dict[str, float]:
        """TTFT (a 1-token generate), decode tok/s from the difference to an n-token one."""
        ids = torch.tensor(prompts, device=self.device)
        b = len(prompts)
        self._generate(ids, 2)  # warm-up
        ttft, decode, total = [], [], []
        for _ in range(runs):
            t1 = self._generate(ids, 1)
            tn = self._generate(ids, new_tokens)
            ttft.append(t1)
            decode.append(b * (new_tokens - 1) / (tn - t1))
            total.append(b * new_tokens / tn)
        return {
            "ttft_ms": statistics.median(ttft) * 1e3,
            "decode_tok_s": statistics.median(decode),
            "total_tok_s": statistics.median(total),
            "runs": runs,
            "new_tokens": new_tokens,
        }

    @torch.inference_mode()
    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """fp32 logits [V] at the last prompt position, in the model's current dtype."""
        ids = torch.tensor([prompt], device=self.device)
        return self.model(ids).logits[0, -1].float().cpu()

    def to_fp32(self) -> None:
        self.model.float()


class _TokenTimes:
    """A generate() streamer that notes when each put arrives: the prompt, then each token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())  # generate hands over host copies: synced

    def end(self) -> None:
        pass


def timed_generate(
    model: Any, ids: torch.Tensor, new_tokens: int, cache_implementation: str | None = None
) -> tuple[float, float]:
    """HF greedy generate of `new_tokens` (>= 2) after an untimed one-token warm-up ->
    (TTFT s, decode tok/s), both from one timed run: when the first token arrived, and the
    rest after it (two runs of different lengths subtracted can come out negative on a busy
    host)."""
    from transformers import GenerationConfig

    def run(n: int, streamer: _TokenTimes | None) -> None:
        cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
            cache_implementation=cache_implementation,
        )
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=cfg, streamer=streamer
            )

    run(1, None)
    times = _TokenTimes()
    start = time.perf_counter()
    run(new_tokens, times)
    assert len(times.times) == new_tokens + 1, "one put for the prompt, one per token"
    first, last = times.times[1], times.times[-1]
    return first - start, (new_tokens - 1) / (last - first)
