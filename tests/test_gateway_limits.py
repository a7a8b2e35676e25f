"""Every server.* setting of the gateway does what it says: max_message_mb (after
decompression), max_streams_per_connection, keepalive_s (server pings, and the policy for
client pings), request_timeout_s (the tokens so far, finish reason length; KV freed),
metrics_host, one server per port (no SO_REUSEPORT), and a metrics port that is taken is
reported. Each test fails when
its setting is ignored."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.config.file import parse_config
from hybridgen.config.sections import ServerConfig
from hybridgen.gateway.main import parse_args, with_flags
from hybridgen.runtime.startup_error import EXIT_STARTUP
from hybridgen.serving.engine_backend import EngineBackend
from hybridgen.serving.server import grpc_options
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway_harness import InProcessGateway, ScriptedBackend, serving
from tests.test_gateway import GRPCURL, _free_port

MB = 2**20


def stub(target: str, **options: Any) -> tuple[grpc.Channel, pb_grpc.GenerationServiceStub]:
    channel = grpc.insecure_channel(target, options=list(options.items()))
    return channel, pb_grpc.GenerationServiceStub(channel)


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()  # type: ignore[no-any-return]


# -- max_message_mb -------------------------------------------------------------------------


def test_the_config_keys_reach_the_gateway() -> None:
    section = parse_config(
        {
            "server": {
                "max_message_mb": 3,
                "max_streams_per_connection": 7,
                "keepalive_s": 2.5,
                "request_timeout_s": 9,
                "metrics_host": "127.0.0.2",
                "reflection": False,
                "api_key_file": "/k",
                "tls": {"cert_file": "/c", "key_file": "/k2"},
            }
        }
    ).server
    got = with_flags(section, parse_args(["--port", "5", "--api-key-file", "/flag"]))
    assert (got.max_message_bytes, got.max_streams_per_connection) == (3 * MB, 7)
    assert (got.keepalive_s, got.request_timeout_s, got.metrics_host) == (2.5, 9.0, "127.0.0.2")
    assert (got.reflection, got.api_key_file, got.port) == (False, "/flag", 5)
    assert (got.tls.cert_file, got.tls.key_file) == ("/c", "/k2")
    options = dict(grpc_options(got))
    assert options["grpc.max_receive_message_length"] == 3 * MB
    assert options["grpc.max_concurrent_streams"] == 7
    assert options["grpc.keepalive_time_ms"] == 2500


def test_the_cpu_daemons_socket_leaves_the_public_limits_to_the_gateway() -> None:
    """The daemons' own socket carries the gateway's one connection: no keys, TLS, timeout,
    stream cap, metrics or HTTP of its own; the queue and message size are the config's."""
    from hybridgen.cpu_daemon.main import socket_settings

    public = parse_config(
        {
            "server": {
                "max_queue": 9,
                "max_message_mb": 3,
                "max_streams_per_connection": 7,
                "request_timeout_s": 9,
                "api_key_file": "/k",
                "http_port": 8080,
                "tls": {"cert_file": "/c", "key_file": "/k2"},
            }
        }
    ).server
    own = socket_settings(public)
    assert (own.max_queue, own.max_message_bytes) == (9, 3 * MB)
    assert (own.api_key_file, own.tls.enabled, own.request_timeout_s) == (None, False, 0.0)
    assert (own.metrics_port, own.http_port) == (0, 0)
    assert own.max_streams_per_connection == ServerConfig().max_streams_per_connection


def test_messages_beyond_max_message_mb_are_refused_compressed_or_not() -> None:
    with serving(ScriptedBackend(), max_message_mb=1) as gw:
        channel, api = stub(gw.target)
        with channel:
            big = pb.TokenizeRequest(text="x" * int(1.4 * MB))
            assert code_of(lambda: api.Tokenize(big, timeout=10)) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            # A gzip bomb: 8 MB of prompt in about 8 KB on the wire.
            bomb = pb.GenerateRequest(prompt="a" * (8 * MB), max_tokens=1)
            start = time.monotonic()
            refused = code_of(
                lambda: list(api.Generate(bomb, compression=grpc.Compression.Gzip, timeout=10))
            )
            assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - start < 1.0
            # Under the limit, the size is the prompt's problem, named as such.
            small = pb.TokenizeRequest(text="x" * int(0.9 * MB))
            with pytest.raises(grpc.RpcError) as err:
                api.Tokenize(small, compression=grpc.Compression.Gzip, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("text: is 943718 bytes")


# -- max_streams_per_connection -------------------------------------------------------------


def test_a_connection_gets_at_most_max_streams_per_connection_calls_at_once() -> None:
    backend = ScriptedBackend(period_s=0.1)
    with serving(backend, max_streams_per_connection=2) as gw:
        channel, api = stub(gw.target)
        first_token: dict[int, float] = {}
        start = time.monotonic()

        def call(i: int) -> None:
            request = pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=10)
            for _ in api.Generate(request, timeout=30):
                first_token.setdefault(i, time.monotonic() - start)

        with channel:
            threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        waits = sorted(first_token.values())
        # Two start at once; the third waits for one of them to end (10 x 0.1 s).
        assert waits[1] < 0.6 and waits[2] > 0.9, waits


# -- keepalive_s ----------------------------------------------------------------------------

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _PING, _GOAWAY = 0x4, 0x6, 0x7
_ACK = 0x1
_ENHANCE_YOUR_CALM = 0xB


def _frame(kind: int, flags: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + bytes(4) + payload


class RawHttp2:
    """A bare HTTP/2 connection: what a client that stopped answering looks like."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(_PREFACE + _frame(_SETTINGS, 0))

    def read(self, timeout: float) -> tuple[int, int, bytes] | None:
        """The next frame (kind, flags, payload); None on timeout; (-1, 0, b"") on close."""
        self.sock.settimeout(timeout)
        try:
            head = self._exactly(9)
        except TimeoutError:
            return None
        if head is None:
            return (-1, 0, b"")
        payload = self._exactly(int.from_bytes(head[:3], "big")) or b""
        if head[3] == _SETTINGS and not head[4] & _ACK:
            self.sock.sendall(_frame(_SETTINGS, _ACK))
        return head[3], head[4], payload

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            try:
                chunk = self.sock.recv(n - len(data))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            data += chunk
        return data

    def frames_for(
        self, seconds: float, answer_pings: bool, ping_every: float | None = None
    ) -> list[tuple[float, int, bytes]]:
        """(time, kind, payload) of every frame for `seconds` or until the connection ends,
        answering the server's pings or not, and sending our own every `ping_every` s."""
        start, got, next_ping = time.monotonic(), [], 0.0
        while (now := time.monotonic() - start) < seconds:
            if ping_every is not None and now >= next_ping:
                try:
                    self.sock.sendall(_frame(_PING, 0, b"client!!"))
                except OSError:
                    got.append((now, -1, b""))
                    break
                next_ping += ping_every
            wait = seconds - now if ping_every is None else min(next_ping, seconds) - now
            frame = self.read(max(wait, 0.001))
            if frame is None:
                continue
            kind, flags, payload = frame
            got.append((time.monotonic() - start, kind, payload))
            if kind == -1:
                break
            if kind == _PING and not flags & _ACK and answer_pings:
                self.sock.sendall(_frame(_PING, _ACK, payload))
        return got

    def close(self) -> None:
        self.sock.close()


def test_keepalive_s_pings_idle_connections_and_drops_silent_ones() -> None:
    with serving(ScriptedBackend(), keepalive_s=1.0) as gw:
        client = RawHttp2(gw.gateway.port)
        try:
            frames = client.frames_for(6.0, answer_pings=False)
        finally:
            client.close()
    pings = [t for t, kind, _ in frames if kind == _PING]
    assert pings and pings[0] < 1.8, frames
    ended = [t for t, kind, _ in frames if kind in (_GOAWAY, -1)]
    # An unanswered ping closes the connection keepalive_s later.
    assert ended and ended[0] < pings[0] + 1.8, frames


def test_keepalive_s_sets_how_often_clients_may_ping() -> None:
    with serving(ScriptedBackend(), keepalive_s=0.5) as gw:
        rude, polite = RawHttp2(gw.gateway.port), RawHttp2(gw.gateway.port)
        polite_frames: list[tuple[float, int, bytes]] = []
        # Every 0.6 s is allowed (>= min(keepalive_s, 10 s)), every 20 ms is too often.
        beside = threading.Thread(
            target=lambda: polite_frames.extend(polite.frames_for(3.0, True, ping_every=0.6))
        )
        beside.start()
        try:
            rude_frames = rude.frames_for(3.0, answer_pings=True, ping_every=0.02)
        finally:
            beside.join()
            polite.close()
            rude.close()
    goaway = [p for _, kind, p in rude_frames if kind == _GOAWAY]
    assert goaway, rude_frames
    assert struct.unpack(">I", goaway[0][4:8])[0] == _ENHANCE_YOUR_CALM
    assert b"too_many_pings" in goaway[0][8:]
    assert not [k for _, k, _ in polite_frames if k in (_GOAWAY, -1)], polite_frames


# -- one server per port --------------------------------------------------------------------


def test_a_second_server_on_the_same_port_fails_at_start() -> None:
    in_use = r"cannot listen on 127\.0\.0\.1:\d+: the port is in use"
    with serving(ScriptedBackend()) as first, pytest.raises(OSError, match=in_use):
        InProcessGateway(ScriptedBackend(), ServerConfig(port=first.gateway.port))


# -- request_timeout_s ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_backend(checkpoint: Any) -> EngineBackend:
    config = EngineConfig(
        model=str(checkpoint("llama3")), device="cpu", gpu_memory_mb=256, max_model_len=1024
    )
    return EngineBackend(config)


def test_request_timeout_s_ends_a_call_with_what_it_generated_and_frees_its_kv(
    engine_backend: EngineBackend,
) -> None:
    """A call past server.request_timeout_s that has tokens ends there as if it reached its
    max_tokens (finish reason length; llama.cpp's time limit does the same), keeping them
    rather than throwing them away with an error; its KV is freed. One with no token yet is
    DEADLINE_EXCEEDED (test_openai_api: test_the_request_timeout_holds_over_http)."""
    with serving(engine_backend, request_timeout_s=1.0) as gw:
        channel, api = stub(gw.target)
        with channel:
            request = pb.GenerateRequest(
                prompt_token_ids=[1, 2, 3], max_tokens=1000, ignore_eos=True
            )
            start = time.monotonic()
            replies = list(api.Generate(request, timeout=60))
            took = time.monotonic() - start
            tokens = [t for reply in replies for t in reply.token_ids]
            assert replies[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert replies[-1].usage.completion_tokens == len(tokens)
            assert 1.0 <= took < 3.0 and 0 < len(tokens) < 1000
            deadline = time.monotonic() + 5
            while True:
                info = api.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
                if info.kv_blocks_used == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert (info.kv_blocks_used, info.running_requests) == (0, 0)


# -- metrics_host, a taken metrics port -----------------------------------------------------


def _gateway_main(tmp_path: Path, server: str) -> subprocess.Popen[str]:
    config = tmp_path / "hybridgen_config.yaml"
    config.write_text(f"server:\n  runtime_dir: {tmp_path}\n{server}")
    argv = [sys.executable, "-m", "hybridgen.gateway.main", "--config", str(config)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return int(reply.status)


def test_metrics_host_and_the_rest_of_the_section_in_the_gateway_process(tmp_path: Path) -> None:
    port, metrics = _free_port(), _free_port()
    proc = _gateway_main(
        tmp_path,
        f"  port: {port}\n  metrics_port: {metrics}\n  metrics_host: 127.0.0.2\n"
        "  max_message_mb: 1\n  reflection: false\n",
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # up once the port answers
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert _get(f"http://127.0.0.2:{metrics}/metrics") == 200
        with pytest.raises(OSError):
            _get(f"http://127.0.0.1:{metrics}/metrics")
        channel, api = stub(f"127.0.0.1:{port}")
        with channel:
            big = pb.TokenizeRequest(text="x" * int(1.4 * MB))
            assert code_of(lambda: api.Tokenize(big, timeout=10)) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED
            )
        assert GRPCURL is not None
        listed = subprocess.run(
            [GRPCURL, "-plaintext", f"127.0.0.1:{port}", "list"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert listed.returncode != 0 and "reflection" in listed.stderr.lower()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_taken_metrics_port_is_logged_with_the_reason(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        metrics = taken.getsockname()[1]
        proc = _gateway_main(tmp_path, f"  port: {_free_port()}\n  metrics_port: {metrics}\n")
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_STARTUP  # a start-up error: the unit does not restart it
    assert "cannot_serve_metrics" in out and f"127.0.0.1:{metrics}" in out, out
    assert "Address already in use" in out
