"""B7's accelerate baseline (`python -m hybridgen.benchmarks.dense_offload_bench`) at toy scale
on the CPU: accelerate's placement within a budget that keeps only the first decoder layer on
the device, a cut model run end to end, and the full depth derived from its layer times."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hybridgen.benchmarks import dense_offload_bench
from hybridgen.benchmarks.accelerate_offload import (
    DEVICE,
    HOST,
    budget_map,
    build,
    meta_model,
    place,
    placed_bytes,
)
from hybridgen.models.presets import preset_spec

TINY = ["--model=tiny-llama", "--device=cpu", "--budget-mb=2", "--prompt-len=32"]
"""tiny-llama in fp32: a 786 KB decoder layer, so 2 MiB (less room for the largest module)
holds the embedding and one layer."""


def test_budget_splits_the_layers_and_every_weight_is_made() -> None:
    placed = place(replace(preset_spec("tiny-llama"), num_layers=3), 2, cuda=False)
    assert placed.device_map["model.embed_tokens"] == DEVICE
    assert placed.device_map["model.layers.0"] == DEVICE
    assert placed.device_map["model.layers.1"] == placed.device_map["model.layers.2"] == HOST
    assert placed.device_map["lm_head"] == HOST
    assert all(p.device.type == "meta" for p in placed.model.parameters())
    built = build(placed)
    weights = [p for n, p in built.model.named_parameters() if n.endswith("proj.weight")]
    assert all(p.device.type == "cpu" for p in built.model.parameters())
    assert all(0.015 < float(w.std()) < 0.025 for w in weights)  # drawn, not left empty
    assert built.devices == ["cpu"]


def test_tied_output_head_is_placed_and_made_once() -> None:
    """A tied head goes where the embedding does, and shares its weights once built."""
    spec = replace(preset_spec("tiny-llama"), tie_word_embeddings=True)
    placed = place(spec, 2, cuda=False)
    assert placed.device_map["lm_head"] == placed.device_map["model.embed_tokens"] == DEVICE
    model = build(placed).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"


def test_cut_model_runs_and_derives_the_full_depth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(dense_offload_bench.hlog, "configure", lambda: None)
    out = tmp_path / "b7.json"
    result = dense_offload_bench.main([*TINY, "--max-new-tokens=4", "--layers=3", f"--out={out}"])
    assert json.loads(out.read_text()) == result and result["status"] == "measured"
    assert result["dtype"] == "float32" and result["ran_on"].startswith("cpu")
    m, full = result["measured"], result["full_depth"]
    assert (m["layers"], m["device_layers"], m["host_layers"]) == (3, 1, 2)
    assert (full["layers"], full["device_layers"], full["host_layers"]) == (4, 1, 3)
    assert m["device_bytes"] == full["device_bytes"]
    assert full["host_bytes"] - m["host_bytes"] == m["layer_bytes"] > 0
    assert m["decode_tok_s"] > 0 and m["ttft_ms"] > 0
    assert set(m["decode_layer_ms"]) == set(m["prefill_layer_ms"]) == {"device", "host"}
    step_ms = 1e3 / m["decode_tok_s"]  # the full depth: one host layer more
    assert 1e3 / full["decode_tok_s"] == pytest.approx(step_ms + m["decode_layer_ms"]["host"])
    assert full["ttft_ms"] == pytest.approx(m["ttft_ms"] + m["prefill_layer_ms"]["host"])
    assert m["decode_rest_ms"] > 0 and m["prefill_rest_ms"] > 0
    assert full["derived"].startswith("not run") and "1 device and 2 host" in full["derived"]
    assert "host_layer_gb_s" not in m  # nothing is copied on the CPU
    assert "4 layers, derived" in capsys.readouterr().out


def test_full_depth_is_the_run_when_uncut() -> None:
    counts = {"layers": 4, "device_layers": 1, "host_layers": 3}
    measured = {**counts, "ttft_ms": 10.0, "decode_tok_s": 5.0}
    full = dense_offload_bench.full_depth(measured, dict(counts))
    assert (full["ttft_ms"], full["decode_tok_s"]) == (10.0, 5.0)
    assert full["derived"].startswith("measured")


@pytest.mark.parametrize("layers", ["1", "5"])
def test_a_cut_without_host_layers_or_past_the_depth_is_refused(
    layers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        dense_offload_bench.main([*TINY, f"--layers={layers}"])
    assert f"--layers: {layers} is not in [2, 4] for this budget" in capsys.readouterr().err


def test_a_cut_that_host_memory_cannot_hold_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the CPU the whole cut is made in host memory: 3 layers of 786 KB and the rest."""
    monkeypatch.setattr(dense_offload_bench, "available_bytes", lambda: 3_000_000)
    with pytest.raises(SystemExit):
        dense_offload_bench.main([*TINY, "--layers=3"])
    err = capsys.readouterr().err  # 2.9 MB against 90 % of 3 MB: one layer less fits
    assert "--layers: 3 layers need 0.0 GB of host memory" in err and "at most 2" in err


def test_the_h200_case_cuts_past_the_device_share_within_host_memory() -> None:
    """bench/run_h200_served.sh b7_hf: B7's shape, budget and prompt; its cut reaches past
    the 12 layers accelerate keeps on the device in bf16, and keeps its host share (77 GB)
    well inside the H200 machine's 128 GB."""
    script = (Path(__file__).parents[1] / "bench/run_h200_served.sh").read_text()
    case = script[script.index("    b7_hf)") :].split(";;")[0]
    argv = case.split("dense_offload_bench", 1)[1].split("--out")[0].replace("\\", " ").split()
    args = dense_offload_bench.build_parser().parse_args(argv)
    assert (args.model, args.budget_mb, args.prompt_len) == ("llama3-70b", 24576, 1024)
    model = meta_model(replace(preset_spec("llama3-70b"), num_layers=args.layers), torch.bfloat16)
    device_map = budget_map(model, args.budget_mb)
    kinds = dense_offload_bench.layer_kinds(device_map, args.layers)
    assert kinds.count("device") == 12 and kinds.count("host") == args.layers - 12 > 0
    assert placed_bytes(model, device_map)["host"] < 90e9
