"""The test checkpoints themselves: they load in transformers, carry the intended config
fields, and the HF reference helpers behave (EOS ignored, sharding, bf16)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybridgen.models.generation_config import load_generation_defaults
from tests import checkpoints as ck
from tests import hf_reference as ref
from tests.test_tokenizer import TEXTS, assert_same_as_hf, write_json


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {k: ck.build_checkpoint(k, tmp_path_factory.mktemp(k)) for k in ck.KINDS}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ck.KINDS)
def test_checkpoint_loads_and_generates(built: dict[str, Path], kind: str) -> None:
    directory = built[kind]
    prompts = ref.sample_prompts(directory, 2, [5, 40])
    assert [len(p) for p in prompts] == [5, 40]
    out = ref.hf_greedy(directory, prompts, 6)
    assert [len(o) for o in out] == [6, 6]
    margins = ref.hf_margins(directory, prompts[1], out[1])
    assert len(margins) == 6 and min(margins) >= 0
    assert ref.hf_logits(directory, prompts[1]).argmax().item() == out[1][0]
    tokenizer = assert_same_as_hf(directory, TEXTS[:6])  # AutoTokenizer next to a config.json
    defaults = load_generation_defaults(directory, tokenizer.eos_token_id)
    assert (
        defaults.eos_token_ids[0] == tokenizer.eos_token_id == ck._tokenizer_ids(directory)["eos"]
    )
    config = json.loads((directory / "config.json").read_text())
    assert config["vocab_size"] == tokenizer.vocab_size and "rope_parameters" not in config
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != config["tie_word_embeddings"]  # noqa: SIM118


def test_config_rope_fields(built: dict[str, Path], tmp_path: Path) -> None:
    rope = {k: json.loads((d / "config.json").read_text()) for k, d in built.items()}
    assert rope["llama3"]["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert rope["llama3"]["rope_theta"] == 500000.0
    assert rope["llama2_linear"]["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert rope["qwen2"]["rope_scaling"] is None and rope["qwen2"]["use_sliding_window"] is False
    assert rope["mistral"]["sliding_window"] == 16
    v5 = json.loads(
        (ck.build_checkpoint("llama3", tmp_path, config_style="v5") / "config.json").read_text()
    )
    assert v5["rope_parameters"]["rope_type"] == "llama3" and "rope_scaling" not in v5
    assert v5["rope_parameters"]["rope_theta"] == 500000.0


@pytest.mark.parametrize(
    ("kind", "change", "length"),
    [
        ("mistral", {"sliding_window": None}, 40),
        ("llama3", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, 100),
    ],
)
def test_checkpoint_features_change_logits(
    built: dict[str, Path], tmp_path: Path, kind: str, change: dict, length: int
) -> None:
    """The sliding window and llama3 rope scaling really act in transformers at test lengths."""
    plain = ck.build_checkpoint(kind, tmp_path, **change)
    prompt = ref.sample_prompts(plain, 1, length)[0]
    assert (ref.hf_logits(built[kind], prompt) - ref.hf_logits(plain, prompt)).abs().max() > 0.1
    # Within the window mistral is unchanged; llama3's scaling alters low frequencies everywhere.
    short = prompt[:16]
    same = torch.allclose(ref.hf_logits(built[kind], short), ref.hf_logits(plain, short), atol=1e-5)
    assert same == (kind == "mistral")


def test_hf_greedy_ignores_eos(built: dict[str, Path], tmp_path: Path) -> None:
    """A stop id in generation_config.json must not cut hf_greedy's continuation short."""
    directory = shutil.copytree(built["llama3"], tmp_path / "copy")
    prompt = ref.sample_prompts(directory, 1, 12)
    expected = ref.hf_greedy(directory, prompt, 8)
    write_json(directory / "generation_config.json", {"eos_token_id": expected[0][2]})
    config = directory / "config.json"
    config.write_text(config.read_text() + " ")  # a new mtime: hf_model reloads the directory
    assert ref.hf_greedy(directory, prompt, 8) == expected


def test_sharded_checkpoint(built: dict[str, Path], tmp_path: Path) -> None:
    directory = ck.build_checkpoint("llama3", tmp_path, max_shard_size="40KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((directory / s).is_file() for s in shards)
    assert not (directory / "model.safetensors").exists()
    prompt = ref.sample_prompts(directory, 1, 20)[0]
    assert torch.equal(ref.hf_logits(directory, prompt), ref.hf_logits(built["llama3"], prompt))


def test_bf16_checkpoint(tmp_path: Path) -> None:
    directory = ck.build_checkpoint("qwen2", tmp_path, dtype=torch.bfloat16, seed=3)
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
