"""GetModelInfo.gpu_mem_peak_reserved_mb: the GPU daemon's peak reserved memory, live. On this
CPU machine the allocator is faked to check the wiring (model info, the Prometheus gauge, the
e2e benchmark's reading); tests/test_gpu.py checks the figure itself on CUDA."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from hybridgen.benchmarks.e2e_plot import gpu_mem_peak
from hybridgen.config.engine import EngineConfig
from hybridgen.engine import info as info_module
from hybridgen.serving.engine_backend import EngineBackend
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.service import model_info_to_pb
from hybridgen.v1 import generation_pb2 as pb

GAUGE = "hybridgen_gpu_memory_peak_reserved_bytes"


def test_cpu_device_reports_zero() -> None:
    assert info_module.peak_reserved_mb(torch.device("cpu")) == 0.0


def test_in_process_backend_reports_the_live_peak(
    checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The figure is read when asked (GetModelInfo, a metrics scrape), not frozen at load."""
    peak = [1.0]
    monkeypatch.setattr(info_module, "peak_reserved_mb", lambda device: peak[0])
    metrics = Metrics()
    config = EngineConfig(model=str(checkpoint("llama3")), device="cpu", max_model_len=64)

    async def scenario() -> dict[str, Any]:
        backend = EngineBackend(config, metrics)
        await backend.start()
        try:
            return await backend.model_info()
        finally:
            await backend.stop()

    info = asyncio.run(scenario())
    assert info["gpu_mem_peak_reserved_mb"] == 1.0
    assert model_info_to_pb(info).gpu_mem_peak_reserved_mb == 1.0
    for value in (321.5, 400.25):
        peak[0] = value
        assert metrics.registry.get_sample_value(GAUGE) == value * 2**20


@pytest.mark.parametrize(
    ("device", "peak", "expected", "source"),
    [
        ("cpu", 0.0, None, "CPU device"),
        ("cuda:0", 40248.5, 40248.5, "GetModelInfo.gpu_mem_peak_reserved_mb"),
        ("cuda:0", 0.0, None, "is 0 on cuda:0"),
    ],
)
def test_e2e_benchmark_reads_the_field(
    device: str, peak: float, expected: float | None, source: str
) -> None:
    info = pb.GetModelInfoResponse(device=device, gpu_mem_peak_reserved_mb=peak)
    value, why = gpu_mem_peak(info)
    assert value == expected and source in why
