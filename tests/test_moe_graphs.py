"""A MoE model's piecewise decode (engine/moe_graphs.py): one piece per layer up to its
router's pick, the experts placed on the host between the pieces, a last piece to the logits.

On the CPU the pieces run eagerly (`graphed=False`) through the same static buffers, padding
and host picks that the CUDA graphs use; test_gpu.py::test_cold_weights_on_cuda_matches_hf
runs them captured.
"""

from __future__ import annotations

import pytest
import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.moe_graphs import MoeDecodeGraphs
from hybridgen.engine.startup import place_moe_gate
from hybridgen.sampling.params import SamplingParams
from tests.hf_reference import hf_greedy, sample_prompts

NEW_TOKENS = 12


@pytest.mark.slow
@pytest.mark.parametrize("gate", ["gpu", "cpu"])
def test_piecewise_decode_gives_hf_greedy_tokens(checkpoint, gate: str) -> None:  # type: ignore[no-untyped-def]
    """Three sequences padded to a piece size of 4, with a 4-slot expert cache (hits, fetches
    and CPU experts between the pieces), the router picking on either side: HF's tokens."""
    path = checkpoint("mixtral")
    prompts = sample_prompts(path, 3, [7, 29, 83])
    config = EngineConfig(
        model=str(path), device="cpu", expert_cache_slots=4, expert_cpu_max_tokens=1
    )
    engine = Engine(config)
    runner = engine.runner
    place_moe_gate(engine.loaded.model, gate)
    graphs = MoeDecodeGraphs(
        engine.loaded.model,
        runner.kv_caches,
        runner.rope,
        4,
        runner.max_blocks,
        engine.device,
        graphed=False,
    )
    assert graphs.inputs.sizes == [1, 2, 4]
    assert all(pick.on == gate for pick in graphs.picks)
    assert engine.experts is not None and engine.experts[0].hit_launches is not None
    replays = []
    run = graphs.run

    def counted(ids: torch.Tensor, batch):  # type: ignore[no-untyped-def]
        replays.append(len(ids))
        return run(ids, batch)

    graphs.run = counted  # type: ignore[method-assign]
    runner.graphs = graphs
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [c.token_ids for c in engine.generate(prompts, greedy)]
    stats = engine.moe_stats()
    engine.release()
    assert got == hf_greedy(path, prompts, NEW_TOKENS)
    assert replays and set(replays) <= {1, 2, 3} and 3 in replays  # padded to 4
    assert stats["cpu_experts"] > 0 and stats["cache_hits"] > 0 and stats["cache_misses"] > 0


def test_router_placement_is_fixed_at_capture(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The pieces end where moe_gate pointed when they were built: logits for a host pick,
    ids and weights for a device pick; moving the placement later changes neither."""
    path = checkpoint("mixtral")
    engine = Engine(EngineConfig(model=str(path), device="cpu"))
    model, runner = engine.loaded.model, engine.runner
    place_moe_gate(model, "cpu")
    graphs = MoeDecodeGraphs(
        model, runner.kv_caches, runner.rope, 1, runner.max_blocks, engine.device, False
    )
    place_moe_gate(model, "gpu")
    with torch.inference_mode():
        _, _, weights, _ = graphs.pieces[1][0].run()
        ids, picked = graphs.picks[0].read(1, weights)
    assert weights.numel() == 0  # the host picks from the logits
    assert ids.shape == (1, model.spec.num_experts_per_tok)
    torch.testing.assert_close(picked.sum(dim=-1), torch.ones(1))
    engine.release()
