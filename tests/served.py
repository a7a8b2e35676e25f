"""`hybridgen serve` on the built-in default model (no --model), for tests that must hold for
whatever that model is: they take its ids and texts from the server, never assume them; or
on a given checkpoint."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path

import grpc

from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc
from tests.test_serving import free_port, wait_serving

MAX_MODEL_LEN = 512


class DefaultServer:
    """The three processes of one instance, serving the default model (or `model`) on the
    CPU, with the OpenAI HTTP API on `http_port`."""

    def __init__(self, tmp: Path, server_config: str = "", model: Path | None = None) -> None:
        self.instance = f"d{uuid.uuid4().hex[:10]}"
        self.port, self.http_port = free_port(), free_port()
        config = tmp / "hybridgen_config.yaml"
        config.write_text(
            f"model:\n  max_model_len: {MAX_MODEL_LEN}\n  max_num_seqs: 8\n"
            "kv_cache:\n  hot_region_mb: 64\n"
            f"server:\n  metrics_port: 0\n  http_port: {self.http_port}\n"
            f"  runtime_dir: {tmp}/run\n{server_config}"
        )
        cmd = [
            *(sys.executable, "-m", "hybridgen.cli.main", "serve", "--config", str(config)),
            *("--port", str(self.port), "--device", "cpu", "--instance", self.instance),
            *(("--model", str(model)) if model is not None else ()),
        ]
        self.log_path = tmp / "serve.log"
        self.run_dir = tmp / "run" / self.instance
        """The instance's runtime folder: each process's log."""
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        wait_serving(self.port, timeout=300, proc=self.proc)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(request, timeout=30).token_ids)

    def info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)

    def stop(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self._log.close()
        return code
