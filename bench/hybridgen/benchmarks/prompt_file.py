"""The prompt file of e2e_benchmark and hybridgen-profiler: JSON lines
`{"prompt": "...", "max_new_tokens": 64}` (max_new_tokens optional), blank lines skipped;
every error names the line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    line: int
    """1-based line of the prompt file."""
    text: str
    max_new_tokens: int | None
    """The line's own limit; None: --max-new-tokens."""


def _parse_line(number: int, raw: str) -> Prompt:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number}: not valid JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise ValueError(f'line {number}: expected an object like {{"prompt": "..."}}')
    unknown = sorted(set(item) - {"prompt", "max_new_tokens"})
    if unknown:
        raise ValueError(
            f"line {number}: unknown key {unknown[0]!r}; allowed prompt, max_new_tokens"
        )
    text, limit = item.get("prompt"), item.get("max_new_tokens")
    if not isinstance(text, str) or not text:
        raise ValueError(f"line {number}: 'prompt' must be a non-empty string")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"line {number}: max_new_tokens={limit!r} is out of range: allowed >= 1")
    return Prompt(number, text, limit)


def load_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of a JSON-lines file (blank lines skipped); errors name the line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    prompts = [_parse_line(n, raw) for n, raw in enumerate(lines, 1) if raw.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts; write one JSON object per line")
    return prompts
