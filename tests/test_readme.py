"""Every command of the README, run as written on this machine, with what the README says it
shows checked.

The commands are the lines of the README's ```sh blocks (a trailing backslash continues a
line), each run by bash from the root of a copy of the repository (its files as they are now,
those git ignores left out, as a git repository of its own, with this checkout's .venv), so
that what they write stays there. What is changed, and why:
- The ports 50051, 8000 and 9400 become free ones, and HYBRIDGEN_PORT, HYBRIDGEN_HTTP_PORT,
  HYBRIDGEN_METRICS_PORT, HYBRIDGEN_INSTANCE and HYBRIDGEN_RUNTIME_DIR point `hybridgen serve`
  at them and at an instance of its own: other servers may run on this machine.
- `hybridgen serve` runs in the background until its banner is printed; the commands after it
  talk to it, and the next serve or the section's end stops it with Ctrl-C's SIGINT (exit 0,
  /dev/shm empty).
- `bash scripts/setup.sh` and `bash scripts/test.sh` are what .ci/run runs, before this test
  and around it; here they are checked to be exactly those lines. `bash scripts/test.sh --fast`
  runs with --collect-only added, so that it selects the fast tests without running them
  inside this suite, and with this checkout's mypy cache copied in (mypy still checks every
  file that differs from the cache; the cache spares the 80 s of a cold start on 2 cores).
- The systemd install runs with /opt and /etc inside the copy, and sudo, useradd, systemctl
  and journalctl as stand-ins that record their arguments (sudo then runs the command): the
  clone, the runtime-only setup and the installed files are real.
Every command must have a check below; a new command without one fails the test, which says
which.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hybridgen.ipc.shm import list_instance

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SERVE = re.compile(r"^\.venv/bin/hybridgen serve(?!.*--print-config)")
BANNER_END = "  try      "
STAND_IN = '#!/bin/sh\necho "$(basename "$0") $*" >> "$RECORD"\n'


@dataclass(frozen=True)
class Command:
    """One command of the README."""

    section: str
    """The ## heading it is under."""
    text: str
    """The command, continuation lines joined."""


def readme_commands() -> list[Command]:
    commands: list[Command] = []
    section, block = "", None
    for line in (ROOT / "README.md").read_text().splitlines():
        if block is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif line.strip() == "```sh":
                block = list[str]()
            continue
        if line.strip() == "```":
            joined = "\n".join(block).replace("\\\n", " ")
            commands += [Command(section, c.strip()) for c in joined.splitlines() if c.strip()]
            block = None
        else:
            block.append(line)
    return commands


@dataclass
class Done:
    """A finished command."""

    returncode: int
    stdout: str
    stderr: str


@dataclass
class Session:
    """A copy of the repository, the free ports, and the server in the background."""

    repo: Path
    tmp: Path
    env: dict[str, str]
    ports: dict[str, str]
    instance: str
    record: Path
    server: subprocess.Popen[bytes] | None = None
    server_out: Path | None = None
    done: list[str] = field(default_factory=list)

    def command_line(self, text: str) -> str:
        for written, free in self.ports.items():
            text = text.replace(written, free)
        return text.replace("/opt/hybridgen", f"{self.tmp}/opt/hybridgen").replace(
            "/etc/", f"{self.tmp}/etc/"
        )

    def run(self, text: str, timeout: float = 600) -> Done:
        line = self.command_line(text)
        assignment = re.match(r"^([A-Za-z_]+)=\$\(", line)
        if assignment:
            name = assignment[1]
            line = f'{line}\nprintf %s "${name}"'
        done = subprocess.run(
            ["bash", "-c", line],
            cwd=self.repo,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if assignment and done.returncode == 0:
            self.env[assignment[1]] = done.stdout
        return Done(done.returncode, done.stdout, done.stderr)

    def start_server(self, text: str) -> str:
        self.stop_server()  # the reader's Ctrl-C before the next serve
        self.server_out = self.tmp / f"serve-{len(self.done)}.out"
        with open(self.server_out, "wb") as out:
            self.server = subprocess.Popen(
                ["bash", "-c", f"exec {self.command_line(text)}"],
                cwd=self.repo,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 300
        while BANNER_END not in self.server_out.read_text(errors="replace"):
            if self.server.poll() is not None or time.monotonic() > deadline:
                self.stop_server()
                pytest.fail(f"{text}: no banner:\n{self.server_out.read_text()[-3000:]}")
            time.sleep(0.3)
        return self.server_out.read_text(errors="replace")

    def stop_server(self) -> None:
        if self.server is None:
            return
        server, self.server = self.server, None
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
        try:
            code = server.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            pytest.fail("hybridgen serve did not stop on SIGINT")
        log = self.server_out.read_text(errors="replace") if self.server_out else ""
        assert code == 0, log[-3000:]
        stops = [log.index(f"stopped {name}") for name in ("gateway", "cpu", "gpu")]
        assert stops == sorted(stops), log
        assert list_instance(self.instance) == []


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    repo = tmp_path / "repo"
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for tracked in filter(None, (f.decode() for f in files)):
        if (ROOT / tracked).is_file():  # a file deleted in this checkout is left out
            (repo / tracked).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / tracked, repo / tracked)
    (repo / ".venv").symlink_to(ROOT / ".venv")
    git = ["git", "-c", "user.name=readme", "-c", "user.email=readme@test"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True, capture_output=True)
    # .gitignore's ".venv/" names a folder; here it is a link to this checkout's.
    (repo / ".git" / "info" / "exclude").write_text("/.venv\n")
    for args in (["add", "-A"], ["commit", "-qm", "the README's checkout"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True)
    if (ROOT / ".mypy_cache").is_dir():  # module doc: ignored by git, so copied after
        shutil.copytree(ROOT / ".mypy_cache", repo / ".mypy_cache")
    (tmp_path / "etc/systemd/system").mkdir(parents=True)  # there on a systemd machine
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("useradd", "systemctl", "journalctl"):
        (bin_dir / name).write_text(STAND_IN)
    (bin_dir / "sudo").write_text(STAND_IN + 'exec "$@"\n')
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    instance = "readme" + uuid.uuid4().hex[:10]
    ports = {"50051": _free_port(), "8000": _free_port(), "9400": _free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDGEN_")}
    record = tmp_path / "stand_ins.txt"
    env.update(PATH=f"{bin_dir}:{env['PATH']}", RECORD=str(record))
    s = Session(repo, tmp_path, env, ports, instance, record)
    try:
        yield s
    finally:
        s.stop_server()


def _serving_env(s: Session) -> None:
    """Where `hybridgen serve` listens and keeps its instance: free ports, its own names."""
    s.env.update(
        HYBRIDGEN_PORT=s.ports["50051"],
        HYBRIDGEN_HTTP_PORT=s.ports["8000"],
        HYBRIDGEN_METRICS_PORT=s.ports["9400"],
        HYBRIDGEN_INSTANCE=s.instance,
        HYBRIDGEN_RUNTIME_DIR=str(s.tmp / "run"),
    )


# -- what each command shows, as the README says ----------------------------------------------

Check = Callable[[Session, Done], None]


def _ok(s: Session, done: Done) -> None:
    assert done.returncode == 0, done.stderr[-3000:]


def shows(*texts: str, where: str = "stdout") -> Check:
    def check(s: Session, done: Done) -> None:
        _ok(s, done)
        out = done.stdout if where == "stdout" else done.stderr
        for text in texts:
            assert text in out, f"{text!r} not in:\n{out[-3000:]}"

    return check


def generated(s: Session, done: Done) -> None:
    """A plain prompt streamed: text, then up to 32 tokens (the model may end it sooner)."""
    _ok(s, done)
    assert done.stdout.strip(), "no text streamed"
    finish = re.search(
        r"finish_reason=(\w+) prompt_tokens=\d+ completion_tokens=(\d+)", done.stderr
    )
    assert finish is not None, done.stderr
    assert finish[1] in ("length", "stop") and 0 < int(finish[2]) <= 32
    assert "synthetic" not in done.stderr  # the default model is a trained one


def answers_paris(s: Session, done: Done) -> None:
    """The README's comment: "The capital of France is Paris." (greedy, the default model)."""
    _ok(s, done)
    assert "Paris" in done.stdout, done.stdout


def grpcurl_found(s: Session, done: Done) -> None:
    _ok(s, done)
    assert os.access(s.env["G"], os.X_OK), s.env["G"]


def grpcurl_generate(s: Session, done: Done) -> None:
    _ok(s, done)
    messages = [json.loads(m) for m in re.findall(r"^\{.*?^\}", done.stdout, re.M | re.S)]
    assert 0 < sum(len(m.get("token_ids", [])) for m in messages) <= 16
    assert messages[-1]["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")


def http_completion(s: Session, done: Done) -> None:
    _ok(s, done)
    body = json.loads(done.stdout)
    assert body["object"] == "text_completion" and body["choices"][0]["text"]
    assert 0 < body["usage"]["completion_tokens"] <= 16


def made_files(*names: str) -> Check:
    def check(s: Session, done: Done) -> None:
        _ok(s, done)
        for name in names:
            assert (s.repo / name).stat().st_size > 0, name

    return check


def printed_config(s: Session, done: Done) -> None:
    _ok(s, done)
    sources = {
        "memory_mb: 24576": "# flag --gpu-memory-mb",
        "max_model_len: 8192": "# flag --max-model-len",
        "metrics_port: 0": "# flag --metrics-port",
        "max_num_seqs: 8": "# env HYBRIDGEN_MAX_NUM_SEQS",
        "block_size: 16": "# default",
    }
    lines = done.stdout.splitlines()
    for value, source in sources.items():
        assert any(x.strip().startswith(value) and x.endswith(source) for x in lines), value


def e2e_written(s: Session, done: Done) -> None:
    _ok(s, done)
    result = json.loads((s.repo / "bench/out/e2e/e2e.json").read_text())
    assert (result["requests"], result["failed"], result["max_new_tokens"]) == (68, 0, 16)
    assert result["tok_per_s"] > 0 and result["server"]["serve_exit_code"] == 0


def profile_written(s: Session, done: Done) -> None:
    _ok(s, done)
    profile = json.loads((s.repo / "tuning_profile.json").read_text())
    assert profile["device"] in ("cpu", "cuda") and "sample" in profile["regions"]
    assert "wrote tuning_profile.json" in done.stdout
    assert "TuningProfile(" not in done.stderr


def fast_tests_selected(s: Session, done: Done) -> None:
    _ok(s, done)
    counts = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", done.stdout)
    assert counts is not None, done.stdout[-2000:]
    assert int(counts[3]) > 0 and int(counts[1]) > 0  # slow tests left out, fast ones kept


def recorded(*calls: str) -> Check:
    def check(s: Session, done: Done) -> None:
        _ok(s, done)
        made = s.record.read_text().splitlines()
        for call in calls:
            assert any(line.startswith(call) for line in made), (call, made)

    return check


def runtime_installed(s: Session, done: Done) -> None:
    """The clone with a venv that serves, and holds none of the test tools."""
    recorded("sudo git clone")(s, done)
    py = s.tmp / "opt/hybridgen/.venv/bin/python"
    tools = ("pytest", "transformers", "ruff", "mypy", "hypothesis")
    probe = "import importlib.util as u, hybridgen.gpu_daemon.main, hybridgen.serving.server\n"
    probe += f"print([m for m in {tools} if u.find_spec(m)])"
    found = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "[]", found.stdout


def key_installed(s: Session, done: Done) -> None:
    _ok(s, done)
    keys = s.tmp / "etc/hybridgen/api_keys"
    assert re.fullmatch(r"[0-9a-f]{64}\n", keys.read_text())
    assert keys.stat().st_mode & 0o777 == 0o600


def config_installed(s: Session, done: Done) -> None:
    _ok(s, done)
    installed = s.tmp / "etc/hybridgen/hybridgen_config.yaml"
    hybridgen = s.tmp / "opt/hybridgen/.venv/bin/hybridgen"
    argv = [str(hybridgen), "config-check", str(installed)]
    check = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.startswith("OK"), check.stderr


def units_installed(s: Session, done: Done) -> None:
    _ok(s, done)
    units = {p.name for p in (s.tmp / "etc/systemd/system").iterdir()}
    assert units == {p.name for p in (ROOT / "systemd").iterdir()}


CI = "run by .ci/run"
"""Not run here: the README's line must be one of .ci/run's, which runs it."""
SERVED = "served"
"""Run in the background until the end of the section."""

CHECKS: list[tuple[str, Check | str]] = [
    (r"^bash scripts/setup\.sh\s*(#|$)", CI),
    (r"^bash scripts/test\.sh\s*(#|$)", CI),
    (r"^bash scripts/test\.sh --fast", fast_tests_selected),
    (r"hybridgen models", shows("tiny-llama", "llama3-8b", "seeded random weights")),
    (r"hybridgen generate --chat", answers_paris),
    (r"hybridgen generate \"Hello", generated),
    (r"^G=\$\(", grpcurl_found),
    (r" list$", shows("hybridgen.v1.GenerationService", "grpc.health.v1.Health")),
    (r"Health/Check", shows('"status": "SERVING"')),
    (r"GenerationService/Generate", grpcurl_generate),
    (r"^curl .*/v1/completions", http_completion),
    (r"from openai import OpenAI", answers_paris),
    (r"^curl .*/metrics", shows("hybridgen_requests")),
    (r"^openssl req", made_files("cert.pem", "key.pem")),
    (r"^openssl rand -hex 32 > api_keys", made_files("api_keys")),
    (r"^openssl rand -hex 32 \| sudo install", key_installed),
    (r"--print-config", printed_config),
    (r"hybridgen config-check", shows("OK: hybridgen_config.example.yaml")),
    (r"kv_stress_test", shows("Hot Hit Rate", "Warm Decompress Latency")),
    (r"device_checker", shows("host copy", "GPU")),
    (r"e2e_benchmark", e2e_written),
    (r"hybridgen-profiler", profile_written),
    (r"cli\.offline", shows("finish_reason=", where="stderr")),
    (r"^sudo useradd", recorded("useradd --system")),
    (r"^sudo git clone", runtime_installed),
    (r"^sudo install", config_installed),
    (r"^sudo cp systemd", units_installed),
    (r"^sudo systemctl", recorded("systemctl daemon-reload", "systemctl enable --now")),
    (r"^journalctl", recorded("journalctl -u hybridgen-gpu")),
]


def check_for(command: Command) -> Check | str:
    if SERVE.match(command.text):
        return SERVED
    found = [check for pattern, check in CHECKS if re.search(pattern, command.text)]
    assert len(found) == 1, f"README command without one check in tests/test_readme.py: {command}"
    return found[0]


def run_section(s: Session, section: str) -> None:
    commands = [c for c in readme_commands() if c.section == section]
    assert commands, f"no commands under ## {section}"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        check = check_for(command)
        if check == SERVED:
            banner = s.start_server(command.text)
            assert "HybridGen is serving" in banner
            if "--tls-cert-file" in command.text:  # the banner's own try line answers
                assert "OpenAI   https://localhost:" in banner, banner
                assert "  model    " in banner and "  engine   " in banner, banner
                try_it = re.search(r"^  try      (curl .*)$", banner, re.M)
                assert try_it, banner
                answer = s.run(try_it[1])
                assert answer.returncode == 0 and '"data"' in answer.stdout, answer
            else:
                assert "OpenAI   http://" in banner
            if "--max-model-len 8192" in command.text:
                assert "context 8,192 tokens" in banner and "metrics" not in banner
        elif check == CI:
            assert command.text.split("#")[0].strip() in ci, command.text
        else:
            assert callable(check)
            text = command.text
            if check is fast_tests_selected:  # after the command, before its comment
                text = re.sub(r"\s+#.*$", "", text) + " --collect-only"
            check(s, s.run(text))
        s.done.append(command.text)
    s.stop_server()


SECTIONS = ("Quick start", "Configuration", "Tools", "Tests", "Install as systemd services")


def test_every_command_has_a_check_and_a_section() -> None:
    commands = readme_commands()
    assert len(commands) >= 20
    assert {c.section for c in commands} == set(SECTIONS)
    for command in commands:
        check_for(command)


@pytest.mark.parametrize("section", SECTIONS)
def test_readme_section(section: str, session: Session) -> None:
    if section in ("Quick start", "Configuration"):
        _serving_env(session)
    run_section(session, section)
    assert session.done == [c.text for c in readme_commands() if c.section == section]
