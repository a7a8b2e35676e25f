"""`hybridgen serve` with weights.gpu_layers below the model's layers (models/host_layers.py):
HF's greedy tokens, served, with the layers by placement in GetModelInfo and --explain."""

from __future__ import annotations

import pytest

from hybridgen.v1 import generation_pb2 as pb
from tests.hf_reference import hf_greedy, sample_prompts
from tests.test_serving import Server, wait_serving

NEW_TOKENS = 16


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "compute"), [("llama3", "stream"), ("qwen2", "cpu"), ("llama3", "split")]
)
def test_served_host_layers_give_hf_greedy_tokens(
    checkpoint, tmp_path, kind: str, compute: str
) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint(kind, num_hidden_layers=3)
    prompts = sample_prompts(path, 2, [11, 27])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    weights = f"weights:\n  gpu_layers: 1\n  host_layer_compute: {compute}\n"
    srv = Server(path, tmp_path, extra_config=weights)
    try:
        wait_serving(srv.port, proc=srv.proc)
        assert [srv.greedy(p, NEW_TOKENS) for p in prompts] == expected
        info = srv.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert (info.gpu_layers, info.host_layers) == (1, 2)
        assert info.host_layer_compute == compute and info.host_layer_bytes > 0
        ran = (info.cpu_layer_steps, info.split_layer_steps, info.streamed_layer_steps)
        assert tuple(n > 0 for n in ran) == tuple(compute == c for c in ("cpu", "split", "stream"))
        assert info.host_bytes_per_token > 0
        assert (info.host_cpu_ms_per_token > 0) == (compute != "stream")
        assert (0 < info.host_split_fraction < 1) == (compute == "split")
        assert info.host_layer_max_tokens == 0  # one way for every step
    finally:
        assert srv.stop() == 0
    log = srv.log_path.read_text()
    assert "decoder layers: 1 on the device, 2 in host memory" in log
    each = {
        "stream": "every step streams their weights to the device",
        "cpu": "every step computes them on the CPU",
        "split": "every step computes them split between the CPU and the link",
    }
    assert f"host layers by step: {each[compute]}" in log
