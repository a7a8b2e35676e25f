"""Loading: clear errors naming the file or key, presets, and rope tables against HF."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hybridgen.models.errors import ModelLoadError
from hybridgen.models.loader import load_model, to_hf_state_dict
from hybridgen.models.presets import PRESETS
from hybridgen.models.rope import rope_tables
from hybridgen.models.spec import parse_rope

CPU = torch.device("cpu")


def copy_checkpoint(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures="),
        ({"num_attention_heads": None}, "'num_attention_heads' is missing"),
        ({"hidden_size": -4}, "'hidden_size'=-4"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"dtype": "float64"}, "dtype='float64'"),
    ],
)
def test_bad_config_names_the_key(checkpoint, tmp_path: Path, changes, message) -> None:  # type: ignore[no-untyped-def]
    path = copy_checkpoint(checkpoint("llama3"), tmp_path)
    edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=r"config\.json") as err:
        load_model(str(path), CPU)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("config.json", "config.json is missing"),
        ("tokenizer.json", "tokenizer.json"),
        ("model.safetensors", "no weights found"),
    ],
)
def test_missing_file_is_named(checkpoint, tmp_path: Path, remove: str, message: str) -> None:  # type: ignore[no-untyped-def]
    path = copy_checkpoint(checkpoint("llama3"), tmp_path)
    (path / remove).unlink()
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path), CPU)


def test_missing_shard_and_wrong_shape_are_named(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = copy_checkpoint(checkpoint("qwen2", max_shard_size="100KB"), tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{shard.name} is listed in the index but missing"):
        load_model(str(path), CPU)
    path = copy_checkpoint(checkpoint("qwen2"), tmp_path / "b")
    edit_config(path, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight' has shape"):
        load_model(str(path), CPU)


def test_unknown_model_lists_presets() -> None:
    with pytest.raises(ModelLoadError, match="tiny-llama"):
        load_model("no-such-model", CPU)


@pytest.mark.parametrize(
    ("name", "billions"),
    [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("qwen2-7b", 7.62), ("mistral-7b", 7.25)],
)
def test_presets_have_real_shapes(name: str, billions: float) -> None:
    spec = PRESETS[name]
    assert spec.synthetic
    assert spec.num_parameters() / 1e9 == pytest.approx(billions, rel=0.01)


def test_synthetic_preset_is_seeded_and_round_trips_to_hf_names() -> None:
    a = load_model("tiny-llama", CPU, seed=3)
    b = load_model("tiny-llama", CPU, seed=3)
    c = load_model("tiny-llama", CPU, seed=4)
    wa, wb, wc = (to_hf_state_dict(m.model) for m in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(
        wa["model.layers.0.self_attn.q_proj.weight"], wc["model.layers.0.self_attn.q_proj.weight"]
    )
    assert a.spec.synthetic and a.tokenizer.is_synthetic


ROPE_CASES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "attention_factor": 1.3,
    },
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
]


@pytest.mark.parametrize("rope", ROPE_CASES, ids=lambda r: r["rope_type"])
def test_rope_tables_match_hf(rope: dict) -> None:  # type: ignore[type-arg]
    """Our cos/sin tables equal HF's rotary embedding at every position HF computes alike."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters=dict(rope),
    )
    hf = LlamaRotaryEmbedding(config)
    positions = torch.arange(256)[None]
    cos_hf, sin_hf = hf(torch.zeros(1, dtype=torch.float32), positions)
    spec = parse_rope({"rope_parameters": dict(rope)}, Path("config.json"))
    cos, sin = rope_tables(spec, 32, 256, 256)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])
