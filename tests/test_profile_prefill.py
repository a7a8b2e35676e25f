"""bench/profile_prefill.py (run on the device with llama3-8b) at toy scale on the CPU: each
prompt's prefill timed and profiled, its operators' time summed by kind, and the FLOPs it is
rated by counted as the engine computes them (causal pairs whatever the chunking)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_script import load_bench


def test_causal_pairs_do_not_depend_on_the_chunking() -> None:
    bench = load_bench("profile_prefill")

    class Spec:
        vocab_size, hidden_size, num_heads, head_dim, num_layers = 10, 4, 2, 8, 3

    class Model:
        @staticmethod
        def parameters() -> list:  # type: ignore[type-arg]
            import torch

            return [torch.zeros(10, 4), torch.zeros(100)]  # the embedding and 100 others

    engine = type("E", (), {"spec": Spec, "loaded": type("L", (), {"model": Model})})
    n = 37
    for chunk in (1, 8, 37, 64):
        dense, attn = bench.flops(engine, n, chunk)
        assert dense == 2 * 100 * n
        assert attn == pytest.approx(4 * n * (n + 1) / 2 * 2 * 8 * 3)


def test_profiles_a_prefill_by_kind_of_operator(tmp_path: Path) -> None:
    bench = load_bench("profile_prefill")
    out = tmp_path / "prefill.json"
    args = ["--model=tiny-llama", "--device=cpu", "--prompt-len=48,96", "--chunk=32"]
    assert bench.main([*args, f"--out={out}"]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["prompt_len"] for r in results] == [48, 96]
    for r in results:
        kinds = r["by_kind_s"]
        assert kinds["attention"] > 0 and kinds["gemm"] > 0
        assert sum(kinds.values()) == pytest.approx(r["profiled_s"])
        assert r["tok_s"] == pytest.approx(r["prompt_len"] / r["wall_s"])
        tops = [t["s"] for t in r["top"]]
        assert tops == sorted(tops, reverse=True) and r["top"][0]["kind"] in ("gemm", "other")
