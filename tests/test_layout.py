"""The layout (README, "Layout"): folders that are import paths, and imports that follow the
process boundaries, checked with import-linter on the real tree."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

from hybridgen.models.default_model import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / ".importlinter"
SOURCES = {"shared", "gateway", "cpu_daemon", "gpu_daemon", "bench"}
PROCESSES = ("gateway", "cpu_daemon", "gpu_daemon")


def _roots() -> list[str]:
    text = CONTRACTS.read_text()
    block = re.search(r"root_packages =\n((?:    \S+\n)+)", text)
    assert block is not None
    return block[1].split()


def test_the_contracts_hold() -> None:
    # No process folder imports another; the library imports none of them (nor bench/).
    assert lint_imports(config_filename=str(CONTRACTS), no_cache=True) == 0


def test_the_import_graph_sees_the_real_edges() -> None:
    """The tool maps module names to files: it finds the edges a reader finds."""
    graph = grimp.build_graph(*_roots(), cache_dir=None)
    assert len(graph.modules) > 150
    assert graph.direct_import_exists(
        importer="hybridgen.gpu_daemon.heartbeat", imported="hybridgen.engine.engine"
    )
    assert graph.direct_import_exists(
        importer="hybridgen.cpu_daemon.ring_backend", imported="hybridgen.ipc.channels"
    )
    # And a chain it must report if it appeared: a process reaching another through the library.
    for importer in PROCESSES:
        for imported in PROCESSES:
            if importer != imported:
                chain = graph.find_shortest_chain(
                    importer=f"hybridgen.{importer}",
                    imported=f"hybridgen.{imported}",
                    as_packages=True,
                )
                assert chain is None, chain


def test_every_module_lives_at_its_import_path() -> None:
    for root in _roots():
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, f"{root}."):
            spec = importlib.util.find_spec(info.name)
            assert spec is not None and spec.origin is not None
            path = Path(spec.origin).relative_to(ROOT)
            relative = "/".join(info.name.split("."))
            expected = {f"{relative}.py", f"{relative}/__init__.py"}
            assert path.parts[0] in SOURCES, path
            assert str(Path(*path.parts[1:])) in expected, (info.name, path)


def _loaded_by(code: str) -> set[str]:
    """The modules a fresh interpreter imports running `code`."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}


def test_the_gateway_loads_no_torch() -> None:
    """The gateway process reads the config, proxies to the CPU daemon and, before it reports
    ready, loads the served model's tokenizer: no model code (torch's import alone is ~2.5 s
    of every start on 2 cores)."""
    loaded = _loaded_by(
        "import hybridgen.gateway.main\n"
        "from hybridgen.models.tokenizer_source import load_tokenizer\n"
        f"assert load_tokenizer({DEFAULT_MODEL!r}).encode('Hello')"
    )
    heavy = {m for m in loaded if m.split(".")[0] in ("torch", "triton", "transformers")}
    assert not heavy, sorted(heavy)[:10]
    assert {"hybridgen.gateway.main", "hybridgen.models.gguf_tokenizer"} <= loaded


@pytest.mark.slow
def test_only_the_engine_loads_torch_dynamo() -> None:
    """torch._dynamo (1.2-1.8 s on 2 cores) comes with the prefill's CausalBias, which the
    engine imports at start (not in its first request) and the CPU daemon never needs."""
    cpu = _loaded_by("import hybridgen.cpu_daemon.main")
    assert "torch" in cpu and "torch._dynamo" not in cpu
    assert "torch.nn.attention.bias" in _loaded_by("import hybridgen.engine.engine")


def test_the_readme_walks_one_request_through_at_most_eight_real_files() -> None:
    """README's walk names each file by what it does; a file moved or renamed fails here."""
    layout = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    walk = re.findall(r"^\| (\d+) \| `([^`]+)` \| (.+) \|$", layout, re.MULTILINE)
    assert 1 <= len(walk) <= 8, walk
    assert [int(n) for n, _, _ in walk] == list(range(1, len(walk) + 1))
    missing = [path for _, path, _ in walk if not (ROOT / path).is_file()]
    assert not missing, missing


def test_no_line_packing_past_the_formatter() -> None:
    """STYLE.md: code is as the formatter lays it out; no `fmt: skip` / `fmt: off` packs lines
    (a split by concept, not a line count)."""
    marker = re.compile(r"#\s*fmt:\s*(skip|off)")
    packed = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in (*SOURCES, "tests")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if ".venv" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if marker.search(line)
    ]
    assert not packed, packed
