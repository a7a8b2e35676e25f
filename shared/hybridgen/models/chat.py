"""A chat (OpenAI-style messages) -> the prompt's token ids, with the model's chat template.

The one path every API takes from messages to a prompt (gRPC Generate and Tokenize, and the
HTTP API): validate the messages, render them as transformers' apply_chat_template does
(jinja2 sandbox, chat_template.py), tokenize without adding special tokens (the template
writes its own BOS, as transformers' tokenize=True does). Problems are InvalidChat naming
the field, for INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridgen.models.tokenizer import ChatTemplateError, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 1024


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a chat."""

    role: str
    """system, user, assistant or tool."""
    content: str
    """The turn's text."""


class InvalidChat(ValueError):
    """The messages cannot become a prompt; `field` names the culprit (messages[i].role)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """Raise InvalidChat for an empty or oversized chat, or an unknown role."""
    if not messages:
        raise InvalidChat("messages", "is empty: give at least one message")
    if len(messages) > MAX_MESSAGES:
        raise InvalidChat("messages", f"has {len(messages)} entries; allowed 1..{MAX_MESSAGES}")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidChat(f"messages[{i}].role", f"is {m.role!r}; allowed {', '.join(ROLES)}")


def chat_prompt_ids(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """The token ids of `messages` rendered with the model's chat template."""
    check_messages(messages)
    turns = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as exc:  # no template, or the template refused the turns
        raise InvalidChat("messages", f"cannot be rendered: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=False)
