"""server.cors_origins: the HTTP API's answers to browsers on other origins (CORS), at the
ASGI level: preflights answered before the routes and the key check, allowed origins named
in the answers, nothing for an origin not listed or with the key empty (the default)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import yaml

from hybridgen.config.engine import ConfigError
from hybridgen.config.file import HybridGenConfig, parse_config
from hybridgen.serving.openai_http import OpenAIApi

UI = "http://localhost:3000"


def _ask(origins: tuple[str, ...], method: str, path: str, headers: dict[str, str]) -> Any:
    """(status, {header: value}) of one request to the API's app (no service behind it)."""
    app = OpenAIApi(None, cors_origins=origins).app()  # type: ignore[arg-type]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_a_listed_origin_gets_its_preflight_answered() -> None:
    status, headers = _ask((UI,), "OPTIONS", "/v1/chat/completions", {"Origin": UI, **PREFLIGHT})
    assert status == 200
    assert headers["access-control-allow-origin"] == UI
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()


def test_an_answer_names_the_listed_origin_and_any_with_a_star() -> None:
    status, headers = _ask((UI,), "GET", "/nowhere", {"Origin": UI})
    assert status == 404 and headers["access-control-allow-origin"] == UI
    status, headers = _ask(("*",), "GET", "/nowhere", {"Origin": "https://a.example"})
    assert headers["access-control-allow-origin"] == "*"


def test_another_origin_and_the_default_get_no_cors() -> None:
    other = {"Origin": "https://evil.example", **PREFLIGHT}
    status, headers = _ask((UI,), "OPTIONS", "/v1/chat/completions", other)
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers = _ask((), "OPTIONS", "/v1/chat/completions", {"Origin": UI, **PREFLIGHT})
    assert status == 405 and "access-control-allow-origin" not in headers
    status, headers = _ask((), "GET", "/nowhere", {"Origin": UI})
    assert "access-control-allow-origin" not in headers


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("3", "has the wrong type"),
        ("[3]", "has the wrong type"),
        ("['localhost:3000']", "is out of range"),
        ("['http://ui.example/app']", "is out of range"),
    ],
)
def test_bad_origins_are_refused_naming_the_key(value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=f"cors_origins=.*{words}"):
        parse_config_text(f"server:\n  cors_origins: {value}\n")


def test_origins_parse_from_the_file() -> None:
    config = parse_config_text(f"server:\n  cors_origins: ['{UI}', 'https://chat.example:8443']\n")
    assert config.server.cors_origins == (UI, "https://chat.example:8443")
    assert parse_config_text("server: {}\n").server.cors_origins == ()
    # as a flag or a variable gives it (and the printed config writes it): comma-separated
    both = parse_config_text(f"server:\n  cors_origins: '{UI}, *'\n").server.cors_origins
    assert both == (UI, "*")


def parse_config_text(text: str) -> HybridGenConfig:
    return parse_config(yaml.safe_load(text))
