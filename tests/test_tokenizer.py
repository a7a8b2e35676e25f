"""Tokenizer and generation defaults against transformers; the tiny checkpoint builders."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from hybridgen.models.errors import ModelLoadError
from hybridgen.models.generation_config import load_generation_defaults
from hybridgen.models.tokenizer import ChatTemplateError, Tokenizer, TokenizerFileNotFoundError
from tests import checkpoints as ck

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, trailing   ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "emoji 🙂🚀👍🏽❤️ and a family 👨‍👩‍👧",
    "中文文本 日本語のテキスト 한국어",
    "<|begin_of_text|>special<|end_of_text|> inside <|eot_id|>text",
    "<|begin_of_text|",
    "",
    " ",
    "don't stop , ok ? yes !",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Hi there 🙂 \n"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "中文?"},
]


def hf_tokenizer(directory: Path):  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def assert_same_as_hf(directory: Path, texts: list[str] = TEXTS) -> Tokenizer:
    ours, ref = Tokenizer.from_dir(directory), hf_tokenizer(directory)
    for text in texts:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == ref(text, add_special_tokens=add)["input_ids"], (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text
    rng = random.Random(0)
    for _ in range(5):  # arbitrary ids, special tokens and broken UTF-8 included
        ids = [rng.randrange(ours.vocab_size) for _ in range(30)]
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.vocab_size == len(ref)
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.all_special_ids == ref.all_special_ids
    return ours


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("trained")
    ck.build_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("synthetic")
    Tokenizer.synthetic(300).save(directory)
    return directory


def variant(src: Path, dst: Path, config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of tokenizer dir `src` with tokenizer_config.json updated and files dropped."""
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config or {})
    cfg_path.write_text(json.dumps(cfg))
    return dst


def test_transformers_layout(trained_dir: Path) -> None:
    """transformers 5 writes the template to chat_template.jinja, not into tokenizer_config.json."""
    assert (trained_dir / "chat_template.jinja").read_text() == ck.CHAT_TEMPLATE
    cfg = json.loads((trained_dir / "tokenizer_config.json").read_text())
    assert "chat_template" not in cfg
    assert cfg["tokenizer_class"] == "TokenizersBackend"
    assert (cfg["bos_token"], cfg["eos_token"]) == (ck.BOS, ck.EOS)
    assert Tokenizer.from_dir(trained_dir).model_max_length is None  # saved as 1e30 = unset


def test_trained_matches_transformers(trained_dir: Path) -> None:
    ours = assert_same_as_hf(trained_dir)
    assert 384 <= ours.vocab_size <= 512
    assert ours.encode("hi")[0] == ours.bos_token_id  # BOS from tokenizer.json's post-processor
    assert not ours.is_synthetic


def test_synthetic_matches_transformers(synthetic_dir: Path) -> None:
    assert_same_as_hf(synthetic_dir)
    assert Tokenizer.from_dir(synthetic_dir).vocab_size == 300


def test_synthetic_layout() -> None:
    tok = Tokenizer.synthetic(260)
    assert tok.is_synthetic and tok.vocab_size == 260
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, None)
    assert tok.encode("A\xff", add_special_tokens=False) == [65, 0xC3, 0xBF]
    assert tok.encode("A") == [256, 65]
    assert tok.id_to_token(258) == "<|reserved_special_token_0|>"
    assert tok.token_to_id("<|reserved_special_token_1|>") == 259
    assert tok.all_special_ids == [256, 257]
    with pytest.raises(ValueError, match="260"):
        Tokenizer.synthetic(259)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_synthetic_round_trips_any_text(text: str) -> None:
    tok = _SYNTHETIC
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8")) or "<|" in text  # special-token text is one id
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text.replace(
        ck.BOS, ""
    ).replace(ck.EOS, "")


_SYNTHETIC = Tokenizer.synthetic(512)


@pytest.mark.parametrize("which", ["trained", "synthetic"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    request: pytest.FixtureRequest, which: str, add_generation_prompt: bool
) -> None:
    directory = request.getfixturevalue(f"{which}_dir")
    ours = Tokenizer.from_dir(directory).apply_chat_template(MESSAGES, add_generation_prompt)
    ref = hf_tokenizer(directory).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref


def test_chat_template_layouts(trained_dir: Path, tmp_path: Path) -> None:
    """Template in tokenizer_config.json as a string, as a named list, and in several files."""
    other = "{{ 'OTHER' }}"
    as_string = variant(
        trained_dir,
        tmp_path / "s",
        {"chat_template": "S{{ messages|length }}"},
        drop=("chat_template.jinja",),
    )
    named = [
        {"name": "tool_use", "template": other},
        {"name": "default", "template": "D{{ bos_token }}"},
    ]
    as_list = variant(
        trained_dir, tmp_path / "l", {"chat_template": named}, drop=("chat_template.jinja",)
    )
    files = variant(trained_dir, tmp_path / "f", {"chat_template": "ignored: files win"})
    (files / "additional_chat_templates").mkdir()
    (files / "additional_chat_templates" / "tool_use.jinja").write_text(other)
    for directory in (as_string, as_list, files):
        ref = hf_tokenizer(directory).apply_chat_template(MESSAGES, tokenize=False)
        assert Tokenizer.from_dir(directory).apply_chat_template(MESSAGES, False) == ref
    assert Tokenizer.from_dir(as_list).apply_chat_template(MESSAGES) == f"D{ck.BOS}"


FEATURE_TEMPLATE = """\
{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
  {%- if m.role not in ['system', 'user', 'assistant'] -%}
    {{ raise_exception('bad role ' + m.role) }}
  {%- endif -%}
  {%- if m.role == 'system' %}{% continue %}{% endif -%}
  {%- set ns.count = ns.count + 1 -%}
  {{ m.role }}={{ m.content | tojson }} {{ dict(a=1) | tojson }}
  {% if m.reasoning_content is defined %}<think>{{ m.thinking }}</think>{% endif %}
  {% generation %}[{{ loop.index }}]{% endgeneration %}
{% endfor %}
n={{ ns.count }} year={{ strftime_now('%Y') }} eos={{ eos_token }} x={{ custom | default('-') }}
{%- if add_generation_prompt %}
>>> {% endif %}"""


def test_chat_template_sandbox_globals(trained_dir: Path, tmp_path: Path) -> None:
    directory = variant(trained_dir, tmp_path / "t", drop=("chat_template.jinja",))
    (directory / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    ours, ref = Tokenizer.from_dir(directory), hf_tokenizer(directory)
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "<b>&</b>", "reasoning": "hmm", "x": None},
    ]
    for gen in (True, False):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, gen) == expected
    assert "x=C" in ours.apply_chat_template(messages, custom="C")  # extra template variables
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_files_are_named(trained_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerFileNotFoundError, match=r"tokenizer\.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ModelLoadError)
    bare = variant(trained_dir, tmp_path / "bare", drop=("chat_template.jinja",))
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja"):
        Tokenizer.from_dir(bare).apply_chat_template(MESSAGES)
    (bare / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(bare)


def test_config_special_tokens(trained_dir: Path, tmp_path: Path) -> None:
    """AddedToken dicts, tokens missing from tokenizer.json, extra special tokens, add_bos/eos."""
    config = {
        "bos_token": {
            "__type": "AddedToken",
            "content": ck.BOS,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "pad_token": "<pad>",  # not in tokenizer.json: transformers adds it as a new id
        "extra_special_tokens": ["<|eot_id|>", "<tool>"],
        # transformers 5 ignores both when tokenizer.json exists: its post-processor decides.
        "add_bos_token": False,
        "add_eos_token": True,
    }
    directory = variant(trained_dir, tmp_path / "v", config)
    ours = assert_same_as_hf(directory, [*TEXTS, "a <pad> b <tool> c"])
    assert ours.pad_token_id == ours.vocab_size - 2
    assert ours.settings.add_bos_token is False
    assert ours.encode("x")[0] == ours.bos_token_id


def test_cleanup_spaces_for_wordlevel(tmp_path: Path) -> None:
    """clean_up_tokenization_spaces applies to non-BPE models (and is ignored for BPE)."""
    words = ["[UNK]", "hello", "world", ".", "?", "don", "'", "t", ","]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"clean_up_tokenization_spaces": True, "unk_token": "[UNK]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = assert_same_as_hf(tmp_path, ["hello world . don't , hello ?", "zzz"])
    assert ours.decode(ours.encode("hello .")) == "hello."


@pytest.mark.parametrize("style", ck.TOKENIZER_STYLES)
def test_tokenizer_styles_match_transformers(tmp_path: Path, style: str) -> None:
    ck.build_tokenizer(tmp_path, style)
    ours = assert_same_as_hf(tmp_path, [*TEXTS, "x</s>y <s> z <|im_end|>", "12345 I'M"])
    ref = hf_tokenizer(tmp_path).apply_chat_template(MESSAGES, tokenize=False)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=False) == ref


@pytest.mark.parametrize(
    "config",
    [
        {"legacy": True},
        {"add_prefix_space": False},
        {"tokenizer_class": "PreTrainedTokenizerFast"},  # tokenizer.json as it is
    ],
)
def test_llama2_style_variants(tmp_path: Path, config: dict) -> None:
    """transformers 5 rebuilds a declared LlamaTokenizer's pipeline from these flags."""
    source = tmp_path / "src"
    ck.build_tokenizer(source, "llama2")
    directory = variant(source, tmp_path / "v", config)
    assert_same_as_hf(directory, [*TEXTS, " leading", "x</s>y <s> z", "  "])


def write_json(path: Path, data: object) -> None:
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def test_generation_defaults(tmp_path: Path) -> None:
    assert load_generation_defaults(tmp_path, 7).eos_token_ids == (7,)
    assert load_generation_defaults(tmp_path, None).eos_token_ids == ()
    write_json(tmp_path / "config.json", {"eos_token_id": [3, 4], "bos_token_id": 1})
    defaults = load_generation_defaults(tmp_path, 7)
    assert (defaults.eos_token_ids, defaults.bos_token_id, defaults.temperature) == (
        (3, 4),
        1,
        None,
    )
    generation = {
        "eos_token_id": 5,
        "pad_token_id": 0,
        "do_sample": True,
        "temperature": 1,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_new_tokens": 64,
        "max_length": 128,
    }
    write_json(tmp_path / "generation_config.json", generation)
    defaults = load_generation_defaults(tmp_path, 7)
    assert defaults.eos_token_ids == (5,) and defaults.bos_token_id == 1
    assert (defaults.pad_token_id, defaults.do_sample, defaults.temperature) == (0, True, 1.0)
    assert (defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (0.9, 20, 1.05)
    assert (defaults.max_new_tokens, defaults.max_length) == (64, 128)


@pytest.mark.parametrize(
    ("content", "key"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"eos_token_id": ["x"]}, "eos_token_id"),
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"do_sample": "yes"}, "do_sample"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ("{broken", "generation_config.json"),
    ],
)
def test_generation_defaults_errors(tmp_path: Path, content: object, key: str) -> None:
    write_json(tmp_path / "generation_config.json", content)
    with pytest.raises(ModelLoadError, match=r"generation_config\.json") as info:
        load_generation_defaults(tmp_path, None)
    assert key in str(info.value)
