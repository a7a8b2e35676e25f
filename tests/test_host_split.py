"""Host layers loaded straight into host memory, int8 / int4 host layers computed by the
CPU's kernels, the row split between the CPU and the link, and the prefetch order
(models/host_layers.py, models/host_weights.py, models/host_load.py)."""

from __future__ import annotations

import pytest
import torch

from hybridgen.cli.explain import layer_lines
from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.host_layer_setup import place, rebalance, split_fraction, time_together
from hybridgen.experts.latency import LatencyModel
from hybridgen.models.host_layers import (
    PARTS,
    HostLayers,
    ResultRooms,
    cpu_shares,
    split_rows,
)
from hybridgen.models.host_weights import HostProjection
from hybridgen.models.loader import load_model
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.service import model_info_to_pb
from tests.kernel_helpers import DEVICE

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 33, 7, 81, 4, 19], [300, 2, 2, 150]]


def projection_bytes(model: torch.nn.Module, layers: range) -> int:
    return sum(
        p.numel() * p.element_size()
        for i in layers
        for path in PARTS
        for p in model.get_submodule(f"layers.{i}.{path}").parameters()
    )


def test_split_fraction_balances_cpu_and_link() -> None:
    """f * cpu = (1 - f) * link: the B7 figures (19 GB/s of int4 on the CPU, 52 GB/s PCIe)
    give the CPU 27 % of the rows; each side then takes 0.73 / 52 GB/s of a layer."""
    layer = 450_000_000
    latency = LatencyModel(layer / 19e9, 0.0, 52e9, layer)
    f = split_fraction(latency)
    assert f == pytest.approx(19 / (19 + 52))
    assert f * latency.cpu_s(1) == pytest.approx((1 - f) * latency.fetch_s)
    assert split_fraction(LatencyModel(0.0, 0.0, 1.0, 0)) == 0.0


def test_rebalance_from_both_sides_timed_at_once() -> None:
    """Timed together at f = 0.5, the CPU's half took 2 ms and the link's 1 ms: a whole layer
    costs the CPU 4 ms and the link 2 ms, so the CPU should take a third, where both sides
    take 1.33 ms. Outside (0, 1) or without times, the share stays."""
    f = rebalance(0.5, 2e-3, 1e-3)
    assert f == pytest.approx(1 / 3)
    assert f * 4e-3 == pytest.approx((1 - f) * 2e-3)
    assert rebalance(0.25, 1e-3, 1e-3) == pytest.approx(0.25)  # balanced already
    assert rebalance(0.0, 1e-3, 1e-3) == 0.0 and rebalance(1.0, 1e-3, 1e-3) == 1.0
    assert rebalance(0.5, 0.0, 1e-3) == 0.5


def test_time_together_runs_both_sides_of_the_first_layer() -> None:
    """The CPU's rows and the link's copy of the rest of one host layer, at once: both sides
    timed, only the first layer re-split (the others keep their rows until place)."""
    loaded = load_model("tiny-llama", CPU, gpu_layers=1)
    host = loaded.model.host_layers
    assert host is not None
    before = [p.cpu_rows for p in host.projections[1]]
    cpu_s, link_s = time_together(host, 0.5)
    assert cpu_s > 0 and link_s > 0
    assert [p.cpu_rows for p in host.projections[0]] == cpu_shares(host.projections[0], 0.5)
    assert any(p.cpu_rows for p in host.projections[0])
    assert [p.cpu_rows for p in host.projections[1]] == before


def test_cpu_shares_take_the_largest_parts_first() -> None:
    """The CPU's share of a layer's bytes comes from its largest projections, whole, then
    one split in blocks; the smaller ones stay on the device (no round trip for them).
    llama3-70b's int4 parts at an eighth of their size (qkv 1,280, o 1,024, gate_up 7,168,
    down 1,024 rows of 1,024 / 3,584 inputs): at f = 0.5 only gate_up splits, at 0.75
    gate_up is the CPU's whole and down splits; 0 and 1 give none and all."""
    shapes = [(1280, 1024), (1024, 1024), (7168, 1024), (1024, 3584)]

    def int4(n: int, k: int) -> HostProjection:
        scale = torch.empty(n, k // 128, dtype=torch.bfloat16)
        rows = {"codes": torch.empty(n, k // 2, dtype=torch.uint8), "scale": scale}
        return HostProjection("int4", 128, {**rows, "zero": scale.clone()})

    parts = [int4(n, k) for n, k in shapes]
    total = sum(p.nbytes() for p in parts)
    half = cpu_shares(parts, 0.5)
    assert half[0] == half[1] == half[3] == 0 and 0 < half[2] < 7168 and half[2] % 64 == 0
    assert parts[2].nbytes(slice(0, half[2])) == pytest.approx(0.5 * total, rel=0.01)
    more = cpu_shares(parts, 0.75)
    assert more[:3] == [0, 0, 7168] and 0 < more[3] < 1024 and more[3] % 64 == 0
    assert cpu_shares(parts, 0.0) == [0] * 4 and cpu_shares(parts, 1.0) == [n for n, _ in shapes]


def test_split_rows_keep_both_sides_in_blocks() -> None:
    assert split_rows(0.27, 8192, 64) == 2240  # 0.27 * 128 blocks = 34.6 -> 35 blocks
    assert split_rows(0.001, 256, 64) == 64  # each side keeps a block
    assert split_rows(0.999, 256, 64) == 192
    assert split_rows(0.4, 64, 64) == 0 and split_rows(0.6, 64, 64) == 64
    assert split_rows(1.0, 100, 8) == 100 and split_rows(0.0, 100, 8) == 0


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["native", "int4"])
def test_host_layers_load_into_host_memory(fmt: str) -> None:
    """Loaded with gpu_layers=1, the device's tensors (the model's parameters and the two
    staging slots) are the resident layer's, the rest of the model's and the staging's:
    the host layers' projections never were device tensors, and the model is the one drawn
    resident (same tokens)."""
    whole = load_model("tiny-llama", CPU, weights=fmt)  # type: ignore[arg-type]
    split = load_model("tiny-llama", CPU, weights=fmt, gpu_layers=1)  # type: ignore[arg-type]
    host = split.model.host_layers
    assert host is not None and host.host_layers == 3 and host.resolved
    layer = projection_bytes(whole.model, range(1, 2))
    assert host.layer_bytes == layer
    device = sum(p.numel() * p.element_size() for p in split.model.parameters())
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.model.parameters())
    assert device == whole_bytes - 3 * layer
    assert host.staging_bytes == 2 * layer
    assert all(p.fmt == fmt for layer_parts in host.projections for p in layer_parts)
    config = EngineConfig(model="tiny-llama", device="cpu", weights_format=fmt)  # type: ignore[arg-type]
    want = Engine(config, whole).generate(PROMPTS, GREEDY)
    got = Engine(config, split).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_auto_loads_every_layer_into_host_memory_then_keeps_what_fits() -> None:
    """gpu_layers: auto loads every layer into host memory, and the engine moves back the
    most the budget holds (here, with no limit on the budget, all of them)."""
    loaded = load_model("tiny-llama", CPU, gpu_layers="auto")
    host = loaded.model.host_layers
    assert host is not None and host.host_layers == 4 and not host.resolved
    engine = Engine(EngineConfig(model="tiny-llama", device="cpu", gpu_layers="auto"), loaded)
    assert engine.host_layers is None and loaded.model.host_layers is None
    assert projection_bytes(loaded.model, range(4)) > 0  # resident modules again


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_host_layers_agree_with_resident(fmt: str) -> None:
    """int8 / int4 host layers, on the CPU through torch's weight-only kernels (int4
    repacked into its layout), streamed in the device's layout, or split between the two,
    give the same quantized model's greedy tokens fully resident."""
    base = EngineConfig(model="tiny-llama", device="cpu", weights_format=fmt)  # type: ignore[arg-type]
    want = [c.token_ids for c in Engine(base).generate(PROMPTS, GREEDY)]
    for compute in ("cpu", "split", "stream"):
        config = EngineConfig(
            model="tiny-llama",
            device="cpu",
            weights_format=fmt,  # type: ignore[arg-type]
            gpu_layers=1,
            host_layer_compute=compute,  # type: ignore[arg-type]
        )
        engine = Engine(config)
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == want, compute
        host = engine.host_layers
        assert host is not None
        forms = [p.cpu_form for layer in host.projections for p in layer if p.cpu_rows]
        assert all(len(f) == 2 for f in forms) and (forms == []) == (compute == "stream")
        if fmt == "int4" and forms:  # torch's CPU int4 layout: [rows, in / 2] uint8
            assert forms[0][0].dtype == torch.uint8


def test_split_prefetches_the_next_layer_while_one_computes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The overlap's order (CPU twin of the CUDA streams): a step fetches the first host
    layer at its start, entering layer i fetches i + 1 into the other slot before any of
    layer i's projections runs, each layer is fetched once per step, and the CPU's rows go
    to the worker thread while the device's rows run."""
    engine = Engine(
        EngineConfig(model="tiny-llama", device="cpu", gpu_layers=1, host_layer_compute="split")
    )
    host = engine.host_layers
    assert host is not None and 0 < host.fraction < 1
    events: list[tuple[str, int]] = []
    fetch, project = HostLayers._fetch, HostLayers.project

    def logged_fetch(self: HostLayers, i: int) -> None:
        if self._filled[i % 2] != (self._step, i):
            events.append(("fetch", i))
        fetch(self, i)

    def logged_project(self: HostLayers, layer: int, part: int, x: torch.Tensor) -> torch.Tensor:
        y = project(self, layer, part, x)
        events.append(("run", layer - self.gpu_layers))
        return y

    monkeypatch.setattr(HostLayers, "_fetch", logged_fetch)
    monkeypatch.setattr(HostLayers, "project", logged_project)
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    step = [("fetch", 0), ("fetch", 1), *[("run", 0)] * 4, ("fetch", 2), *[("run", 1)] * 4]
    assert events[: len(step) + 4] == [*step, *[("run", 2)] * 4]
    assert host._worker is not None  # the CPU's rows ran beside the device's
    host.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_rows_reach_the_device_through_a_kernel_reading_their_room(dtype) -> None:  # type: ignore[no-untyped-def]
    """ResultRooms on the test device (on a CPU, Triton's interpreter reads host memory as
    the H200 reads page-locked memory): the rows come back exact, each (slot, part) keeps
    its room across steps and grows it for a longer step, and rows not of whole 4-byte
    words are copied."""
    rooms = ResultRooms(DEVICE)
    g = torch.Generator().manual_seed(7)
    first = torch.randn(1, 192, generator=g).to(dtype)
    staged = rooms.stage((0, 2), first)
    assert torch.equal(rooms.upload((0, 2), staged).cpu(), first)
    room = rooms._rooms[(0, 2)][0]
    again = torch.randn(1, 192, generator=g).to(dtype)
    assert torch.equal(rooms.upload((0, 2), rooms.stage((0, 2), again)).cpu(), again)
    assert rooms._rooms[(0, 2)][0] is room  # the same room, rewritten
    longer = torch.randn(5, 192, generator=g).to(dtype)
    assert torch.equal(rooms.upload((0, 2), rooms.stage((0, 2), longer)).cpu(), longer)
    assert rooms._rooms[(0, 2)][0].numel() == longer.numel()
    other = torch.randn(3, 64, generator=g).to(dtype)
    assert torch.equal(rooms.upload((1, 0), rooms.stage((1, 0), other)).cpu(), other)
    odd = torch.randn(2, 3, generator=g).to(torch.bfloat16)  # 6 bytes a row
    assert torch.equal(rooms.upload((1, 1), rooms.stage((1, 1), odd)).cpu(), odd)


def test_auto_on_cuda_splits_decode_and_streams_prefill() -> None:
    """CPU twin of auto's placement on CUDA: the timed share splits each projection's rows
    for steps up to the crossover (at least one token: decode), larger ones stream."""
    config = EngineConfig(model="tiny-llama", device="cpu", gpu_layers=1)
    engine = Engine(config)
    host = engine.host_layers
    assert host is not None and host.fraction == 1.0 and host.cpu_max_tokens is None
    place(host, config, cuda=True)
    assert 0 < host.fraction < 1 and host.split
    assert host.cpu_max_tokens is not None and host.cpu_max_tokens >= 1
    # The crossover is measured (beyond 100,000 tokens on the H200's 16-core host for this
    # tiny model), so the test takes it from the placement.
    crossover = host.cpu_max_tokens
    assert host.choose(1) == "host" and host.choose(crossover) == "host"
    assert host.choose(crossover + 1) == "stream"
    # GetModelInfo carries the crossover, and `serve --explain` says what each step does.
    info = model_info_to_pb(host.placement())
    assert info.host_layer_max_tokens == crossover
    assert layer_lines(info)[1] == (
        f"host layers by step: steps of up to {crossover} tokens (decode) compute them split "
        "between the CPU and the link, larger ones (prefill chunks) stream their weights to "
        "the device"
    )
    engine.release()


@pytest.mark.slow
def test_b7_served_config_is_llama3_70b_int4_in_24_gb() -> None:
    """bench/served/b7.yaml (bench/run_h200_served.sh b7) says what issue 23's B7 is, and
    the model's int4 decoder layers (~38.5 GB) are more than the budget: host layers it is."""
    from pathlib import Path

    from hybridgen.config.file import load_config
    from hybridgen.models.presets import parameter_count, preset_spec

    root = Path(__file__).resolve().parents[1]
    config = load_config(root / "bench/served/b7.yaml").engine_config("cuda")
    assert (config.model, config.gpu_memory_mb, config.weights_format) == (
        "llama3-70b",
        24576,
        "int4",
    )
    assert (config.gpu_layers, config.host_layer_compute) == ("auto", "auto")
    assert (config.max_num_seqs, config.max_model_len) == (1, 2048)
    spec = preset_spec("llama3-70b")
    layers = parameter_count(spec) - 2 * spec.vocab_size * spec.hidden_size
    assert 4.5 / 8 * layers > config.gpu_memory_mb * 2**20
    assert "bench/served/b7.yaml" in (root / "bench/run_h200_served.sh").read_text()
