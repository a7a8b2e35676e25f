"""The CUDA fast path: Triton kernels inside the model, CUDA graphs and the memory cap.

Skipped without CUDA. On the CPU the same logic is covered by test_kernels.py (every Triton
kernel under TRITON_INTERPRET=1 against a float64 reference) and test_engine_hf.py (the
engine, eager, against transformers).
"""

from __future__ import annotations

import pytest
import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.info import memory_info
from hybridgen.engine.moe_graphs import MoeDecodeGraphs
from hybridgen.sampling.params import SamplingParams
from tests.hf_reference import hf_greedy, sample_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral"])
def test_cuda_graph_engine_matches_hf(checkpoint, kind: str) -> None:  # type: ignore[no-untyped-def]
    """fp32 on the GPU with Triton kernels and decode graphs gives HF's greedy tokens."""
    path = checkpoint(kind)
    prompts = sample_prompts(path, 5, [7, 29, 83, 40, 3])
    expected = hf_greedy(path, prompts, 24)
    engine = Engine(
        EngineConfig(model=str(path), device="cuda", gpu_memory_mb=2048, max_graph_batch=8)
    )
    assert engine.runner.graphs is not None
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    engine.release()
    assert got == expected


def test_graphs_and_eager_agree_in_bf16(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 3, [11, 50, 30])
    runs = []
    for graphs in (True, False):
        engine = Engine(
            EngineConfig(
                model=str(path),
                device="cuda",
                dtype="bfloat16",
                gpu_memory_mb=2048,
                cuda_graphs=graphs,
                max_graph_batch=4,
            )
        )
        runs.append([c.token_ids for c in engine.generate(prompts, GREEDY)])
        engine.release()
    assert runs[0] == runs[1]


def test_peak_reserved_stays_under_budget() -> None:
    budget_mb = 1024
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(
        EngineConfig(
            model="tiny-llama",
            device="cuda",
            gpu_memory_mb=budget_mb,
            max_num_seqs=32,
            max_graph_batch=32,
        )
    )
    prompts = [list(range(1, 200 + 7 * i)) for i in range(32)]
    engine.generate(
        prompts, SamplingParams(temperature=0.7, seed=1, max_tokens=64, ignore_eos=True)
    )
    peak = torch.cuda.max_memory_reserved() / 2**20
    assert peak <= budget_mb, f"peak reserved {peak:.0f} MiB exceeds the {budget_mb} MiB budget"
    # What GetModelInfo.gpu_mem_peak_reserved_mb reports.
    assert memory_info(engine.device) == {"gpu_mem_peak_reserved_mb": peak}
    engine.release()


def test_bf16_logits_close_to_hf(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The tolerance documented in the README: against HF fp32 on the same weights, the
    relative L2 error of our bf16 logits is at most 2x HF's own bf16 error (plus 1e-3), and
    our bf16 differs from HF bf16 by at most 3x that error (two bf16 roundings apart)."""
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama3")
    engine = Engine(
        EngineConfig(model=str(path), device="cuda", dtype="bfloat16", gpu_memory_mb=2048)
    )
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for prompt in sample_prompts(path, 4, [5, 40, 120, 300]):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            ref16 = hf16(ids).logits[0, -1].float()
            ref32 = hf32(ids).logits[0, -1].float()
        ours = engine.prompt_logits(prompt)

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a - b).norm() / b.norm())

        hf_err = rel(ref16, ref32)
        assert rel(ours, ref32) <= 2 * hf_err + 1e-3, (len(prompt), rel(ours, ref32), hf_err)
        assert rel(ours, ref16) <= 3 * hf_err + 1e-3
    engine.release()


@pytest.mark.parametrize("mode", ["auto", "cpu", "gpu", "split"])
def test_warm_tier_on_cuda_matches_hf(checkpoint, mode: str) -> None:  # type: ignore[no-untyped-def]
    """fp32 on the GPU with most KV spilled to a lossless Warm tier, in each attn_warm mode
    (auto measures the placement), gives HF's greedy tokens. test_warm_tier.py covers the
    same paths with the engine on the CPU."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [150, 97])
    expected = hf_greedy(path, prompts, 24)
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cuda",
            gpu_memory_mb=2048,
            block_size=8,
            num_kv_blocks=6,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            max_model_len=256,
            warm_pool_mb=2,
            warm_codec="lossless",
            attn_warm=mode,
        )
    )
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert engine.warm is not None and engine.warm.stats.spilled_blocks > 0
    engine.release()
    assert got == expected


@pytest.mark.parametrize("case", ["wait", "spill", "swap"])
def test_spill_choices_on_cuda_match_hf(checkpoint, case: str) -> None:  # type: ignore[no-untyped-def]
    """The spill decision's three constructed cases (tests/test_spill_policy.py, their CPU
    twin) with the engine on CUDA: the start-up probes run there (a Warm block's read, a
    block's move), then with the costs fixed each case makes its choice, with HF's tokens."""
    from tests.test_spill_policy import CASES, fixed_costs, hf_pair, run_pair

    path = checkpoint("llama3")
    lengths, new, c, choice = CASES[case]
    prompts = sample_prompts(path, 2, list(lengths))
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cuda",
            gpu_memory_mb=2048,
            block_size=8,
            num_kv_blocks=12,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=96,
            warm_pool_mb=2,
            warm_codec="lossless",
            step_latency_ms=0,
        )
    )
    costs = engine.spill_costs
    assert costs is not None and costs.warm_block_s and costs.move_block_s  # probed on CUDA
    fixed_costs(engine, c, per_unit=c.prefill_s / 40)
    got = run_pair(engine, (prompts[0], new[0]), (prompts[1], new[1]))
    policy = engine.scheduler.policy
    engine.release()
    assert got == hf_pair(path, prompts, new)
    assert policy is not None and policy.counts[choice] >= 1


def test_next_turn_from_warm_on_cuda_matches_hf(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A finished turn written back to Warm on CUDA (one DMA into the registered pool) and
    copied back into Hot for the next turn: HF's tokens (tests/test_prefix_cache.py, its CPU
    twin)."""
    from tests.test_prefix_cache import chat

    path = checkpoint("llama3")
    system, *users = sample_prompts(path, 4, [16, 24, 60, 16])
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cuda",
            gpu_memory_mb=2048,
            block_size=8,
            num_kv_blocks=12,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=96,
            warm_pool_mb=2,
            warm_codec="lossless",
        )
    )
    chat(engine, path, system, users)
    hits = engine.scheduler.prefix_hits
    engine.release()
    assert hits.warm_hits == 1 and hits.warm_tokens > 0


@pytest.mark.parametrize("mode", ["gpu", "split"])
def test_warm_drafts_on_cuda_match_hf(checkpoint, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Drafts attending Hot from the CUDA graphs, checked by the Triton kernels with each
    sequence's rows stacked on its kv heads: HF's greedy tokens, fp32, most keys in Warm.
    test_warm_drafts.py covers the same on the CPU."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [150, 97])
    expected = hf_greedy(path, prompts, 24)
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cuda",
            gpu_memory_mb=2048,
            block_size=8,
            num_kv_blocks=16,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            max_model_len=256,
            warm_pool_mb=2,
            warm_codec="lossless",
            attn_warm=mode,
            warm_draft_tokens=4,
        )
    )
    assert engine.runner.graphs is not None
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    stats = engine.drafts.stats
    engine.release()
    assert got == expected
    assert stats.rounds > 0 and stats.accepted > 0


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2"])
def test_cold_weights_on_cuda_matches_hf(checkpoint, kind: str) -> None:  # type: ignore[no-untyped-def]
    """fp32 Mixtral, Qwen2-MoE (shared expert in the pieces), Qwen3-MoE (q/k norm) and
    DeepSeek-V2 (MLA's latent write and attention captured, grouped routing in the pick) on the
    GPU with their experts in host memory and a 4-slot device cache, decoded from piecewise
    CUDA graphs: HF's greedy tokens, with experts both computed on the CPU and fetched into the
    cache. test_cold_weights.py, test_qwen_moe.py and test_deepseek_v2.py cover the same paths
    with the engine on the CPU, test_moe_graphs.py and test_qwen_moe.py the pieces run eagerly."""
    path = checkpoint(kind)
    prompts = sample_prompts(path, 3, [7, 29, 83])
    expected = hf_greedy(path, prompts, 24)
    config = EngineConfig(
        model=str(path),
        device="cuda",
        gpu_memory_mb=2048,
        expert_cache_slots=4,
        expert_cpu_max_tokens=1,
    )
    engine = Engine(config)
    assert isinstance(engine.runner.graphs, MoeDecodeGraphs)  # decode from piecewise graphs
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    stats = engine.moe_stats()
    engine.release()
    assert got == expected
    assert stats["cpu_experts"] > 0 and stats["cache_hits"] > 0 and stats["cache_misses"] > 0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_on_cuda_match_the_cpu_engine(checkpoint, fmt: str) -> None:  # type: ignore[no-untyped-def]
    """A Mixtral checkpoint with its experts converted to int8 / int4 at load: the CUDA engine
    (device cache and CPU experts) gives the CPU engine's greedy tokens. A checkpoint, not a
    synthetic preset: presets draw on the target device's own generator, so a CUDA and a CPU
    build are different models. test_expert_format.py covers the formats on the CPU."""
    path = checkpoint("mixtral")
    prompts = sample_prompts(path, 2, [31, 12])

    def tokens(device: str) -> list[list[int]]:
        config = EngineConfig(
            model=str(path),
            device=device,
            gpu_memory_mb=2048,
            expert_cache_slots=4,
            expert_cpu_max_tokens=1,
            expert_format=fmt,  # type: ignore[arg-type]
        )
        engine = Engine(config)
        got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
        stats = engine.moe_stats()
        engine.release()
        assert stats["cpu_experts"] > 0 and stats["gpu_experts"] > 0
        return got

    assert tokens("cuda") == tokens("cpu")


def test_cuda_oom_in_a_step_ends_only_its_requests(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A real CUDA out-of-memory inside a step (the fault drill allocates more than the
    device has): the request in that step ends with RESOURCE_EXHAUSTED, its KV is freed, the
    queued requests then get HF's tokens, and the device keeps working."""
    from hybridgen.engine.step_errors import ErrorCode
    from hybridgen.engine.step_faults import FaultDrill

    path = checkpoint("llama3")
    prompts = sample_prompts(path, 3, [9, 14, 6])
    expected = hf_greedy(path, prompts, 24)
    engine = Engine(
        EngineConfig(
            model=str(path), device="cuda", gpu_memory_mb=2048, max_num_seqs=1, decode_steps=1
        )
    )
    engine.faults = FaultDrill("2:oom")
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    errors = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.error is not None:
                errors[out.request_id] = out.error
    assert list(errors) == ["r0"] and errors["r0"].code is ErrorCode.RESOURCE_EXHAUSTED
    assert "OutOfMemoryError" in str(errors["r0"])
    assert [tokens["r1"], tokens["r2"]] == expected[1:]
    assert engine.pool.num_used == 0
    engine.release()
