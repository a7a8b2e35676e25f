"""Overhead of the process split (BENCHMARKS.md B5), measured side by side in one run.

    python -m hybridgen.benchmarks.serving_overhead --device cpu \
        --out bench/results/serving_overhead_cpu.json

1. Decode ms/token of one greedy request (ignore_eos, a fixed prompt): the engine in this
   process (`Engine.step` loop) vs `hybridgen serve` (GPU daemon, rings, CPU daemon,
   gateway) over gRPC, both from one config file so the engine settings are identical.
   Runs alternate between the two so the noise of a shared machine hits both alike.
2. Ring throughput (a burst; the median of --runs) and one-way latency (paced tickets)
   between two processes.
3. The CPU daemon's heartbeat (`CpuHeartbeat`, 2 ms period) lateness on real Channels.

Writes the JSON results file and prints the target table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from hybridgen.benchmarks.ipc_bench import leftovers, measure_jitter, measure_ring
from hybridgen.benchmarks.report import machine_info
from hybridgen.config.file import load_config
from hybridgen.engine.engine import Engine
from hybridgen.ipc import shm
from hybridgen.runtime import log as hlog

log = structlog.get_logger()

# metric -> (comparison, target); from BENCHMARKS.md, workload B5.
TARGETS: dict[str, tuple[str, float]] = {
    "added_ms_per_token": ("<=", 0.15),
    "ring_tickets_per_s": (">=", 200_000.0),
    "heartbeat_jitter_p99_ms": ("<=", 0.5),
}
PROMPT_LEN = 32


@dataclass
class DecodeTiming:
    ttft_ms: float
    """Submission to the first token."""
    decode_ms_per_token: float
    """First to last token, over the tokens after the first (tokens arrive in groups of
    decode_steps, so only the total is comparable, not the gaps between messages)."""
    tokens: int
    messages: int
    """Outputs (in-process steps or streamed messages) that carried tokens."""


def _timing(start: float, stamps: list[tuple[float, int]]) -> DecodeTiming:
    tokens = sum(n for _, n in stamps)
    after_first = tokens - stamps[0][1]
    if after_first <= 0:
        raise ValueError("need more than one output to time decoding; raise --tokens")
    return DecodeTiming(
        ttft_ms=(stamps[0][0] - start) * 1e3,
        decode_ms_per_token=(stamps[-1][0] - stamps[0][0]) * 1e3 / after_first,
        tokens=tokens,
        messages=len(stamps),
    )


def inprocess_once(engine: Engine, prompt: list[int], tokens: int) -> DecodeTiming:
    from hybridgen.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(f"bench-{uuid.uuid4().hex[:8]}", prompt, params)
    stamps: list[tuple[float, int]] = []
    while engine.has_unfinished():
        outs = engine.step()  # step returns host ints, so the device has synced
        now = time.perf_counter()
        n = sum(len(o.new_token_ids) for o in outs)
        if n:
            stamps.append((now, n))
    return _timing(start, stamps)


def served_once(stub: Any, prompt: list[int], tokens: int) -> DecodeTiming:
    from hybridgen.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        max_tokens=tokens,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0),
    )
    stamps: list[tuple[float, int]] = []
    start = time.perf_counter()
    for message in stub.Generate(request, timeout=600):
        if message.token_ids:
            stamps.append((time.perf_counter(), len(message.token_ids)))
    return _timing(start, stamps)


def write_config(
    folder: Path, model: str, tokens: int, sample: str = "gpu", weights: str = "native"
) -> Path:
    """One config for both sides: same model settings (weights.format `weights`), a KV pool
    just big enough (two engines share the device), no metrics port and a private runtime
    folder."""
    from hybridgen.models.presets import PRESETS, preset_spec
    from hybridgen.models.spec import parse_config

    spec = preset_spec(model) if model in PRESETS else parse_config(Path(model) / "config.json")
    max_len = max(16, PROMPT_LEN + tokens + 16)
    pool_mb = 2 * max_len * spec.kv_bytes_per_token(torch.float32) / 2**20
    path = folder / "hybridgen_config.yaml"
    path.write_text(
        f"model:\n  name_or_path: {model}\n  max_model_len: {max_len}\n  max_num_seqs: 4\n"
        f"kv_cache:\n  hot_region_mb: {pool_mb:.3f}\n"
        f"server:\n  metrics_port: 0\n  http_port: 0\n  runtime_dir: {folder}/run\n"
        f"placements:\n  sample: {sample}\nweights:\n  format: {weights}\n"
    )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def served(model: str, device: str, config: Path, report: dict[str, Any]) -> Iterator[Any]:
    """`hybridgen serve` on a free port and a fresh instance; yields a Generation stub.
    On exit: SIGTERM, then `report` gets the exit code and what was left in /dev/shm."""
    import grpc

    from hybridgen.v1 import generation_pb2_grpc as pb_grpc

    instance, port = f"bench{uuid.uuid4().hex[:10]}", _free_port()
    cmd = [sys.executable, "-m", "hybridgen.cli.main", "serve", "--model", model]
    cmd += ["--config", str(config), "--port", str(port), "--device", device]
    cmd += ["--instance", instance]
    log_path = config.parent / "serve.log"
    report.update(instance=instance, serve_command=" ".join(cmd[1:]))
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        log.info("serve_starting", instance=instance, port=port)
        report["serve_ready_s"] = _wait_serving(channel, proc, log_path)
        yield pb_grpc.GenerationServiceStub(channel)
    finally:
        channel.close()
        stop_served(proc, instance, report, signal.SIGTERM)
        log.info("serve_stopped", exit_code=report["serve_exit_code"])


def stop_served(
    proc: subprocess.Popen[bytes], instance: str, report: dict[str, Any], signum: int
) -> None:
    """Stop `hybridgen serve` with `signum` (a minute, then SIGKILL) and record its exit code
    and what it left in /dev/shm, which is then removed."""
    if proc.poll() is None:
        proc.send_signal(signum)
    try:
        report["serve_exit_code"] = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()  # only our own child, after the signal had its minute
        report["serve_exit_code"] = proc.wait()
    report["shm_left_after_stop"] = leftovers(instance)
    shm.unlink_all(instance)  # a clean stop leaves nothing; never leave litter anyway


def _wait_serving(channel: Any, proc: subprocess.Popen[bytes], log_path: Path) -> float:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub, start = health_pb2_grpc.HealthStub(channel), time.monotonic()
    while time.monotonic() - start < 300:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"hybridgen serve exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(grpc.RpcError):
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return time.monotonic() - start
        time.sleep(0.1)
    raise TimeoutError(f"hybridgen serve not SERVING after 300 s (log: {log_path})")


def _median(timings: list[DecodeTiming]) -> dict[str, Any]:
    return {
        "ttft_ms": statistics.median(t.ttft_ms for t in timings),
        "decode_ms_per_token": statistics.median(t.decode_ms_per_token for t in timings),
        "runs": [asdict(t) for t in timings],
    }


def measure_decode(
    model: str, device: str, tokens: int, runs: int, weights: str = "native"
) -> dict[str, Any]:
    """In-process vs served decode; warm-up of each, then `runs` alternating pairs."""
    result: dict[str, Any] = {"tokens": tokens, "prompt_len": PROMPT_LEN}
    with tempfile.TemporaryDirectory(prefix="hg-b5-") as tmp:
        config_path = write_config(Path(tmp), model, tokens, weights=weights)
        config = load_config(config_path).engine_config(device)
        result["engine_config"] = asdict(config)
        result["torch_threads"] = torch.get_num_threads()  # the daemons get the same default
        with served(model, device, config_path, result) as stub:
            engine = Engine(config)
            vocab = engine.spec.vocab_size
            prompt = [(7919 * i + 13) % vocab for i in range(PROMPT_LEN)]  # fixed, not special
            log.info("decode_warmup")
            inprocess_once(engine, prompt, tokens)
            served_once(stub, prompt, tokens)
            local: list[DecodeTiming] = []
            remote: list[DecodeTiming] = []
            for i in range(runs):
                # Alternate which side goes first, so a drift in the machine's load
                # (other jobs on a shared box) does not always favour the same side.
                for side in (0, 1) if i % 2 == 0 else (1, 0):
                    if side == 0:
                        local.append(inprocess_once(engine, prompt, tokens))
                    else:
                        remote.append(served_once(stub, prompt, tokens))
                log.info(
                    "decode_run",
                    run=i + 1,
                    inprocess_ms_tok=round(local[-1].decode_ms_per_token, 4),
                    served_ms_tok=round(remote[-1].decode_ms_per_token, 4),
                )
            engine.release()
    result["inprocess"], result["served"] = _median(local), _median(remote)
    result.update(_compare(local, remote))
    return result


def _compare(local: list[DecodeTiming], remote: list[DecodeTiming]) -> dict[str, Any]:
    """Served minus in-process, as the median over the pairs of adjacent runs: on a shared
    machine the load drifts between runs, and a pair sees about the same load."""
    pairs = list(zip(local, remote, strict=True))
    best_l = min(t.decode_ms_per_token for t in local)
    best_r = min(t.decode_ms_per_token for t in remote)
    return {
        "added_ms_per_token": statistics.median(
            r.decode_ms_per_token - loc.decode_ms_per_token for loc, r in pairs
        ),
        "ratio_served_over_inprocess": statistics.median(
            r.decode_ms_per_token / loc.decode_ms_per_token for loc, r in pairs
        ),
        "added_ttft_ms": statistics.median(r.ttft_ms - loc.ttft_ms for loc, r in pairs),
        # The least-disturbed run of each side: another view of the same noisy data.
        "best_of_runs": {
            "inprocess_ms_per_token": best_l,
            "served_ms_per_token": best_r,
            "added_ms_per_token": best_r - best_l,
            "ratio_served_over_inprocess": best_r / best_l,
        },
    }


def verdicts(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    measured = {
        "added_ms_per_token": result["decode"]["added_ms_per_token"],
        "ring_tickets_per_s": result["ring"]["tickets_per_s"],
        "heartbeat_jitter_p99_ms": result["heartbeat"]["lateness_ms"]["p99"],
    }
    out = {}
    for name, (op, target) in TARGETS.items():
        value = measured[name]
        ok = value <= target if op == "<=" else value >= target
        out[name] = {"target": f"{op} {target:g}", "measured": value, "pass": bool(ok)}
    return out


def print_table(result: dict[str, Any]) -> None:
    d, r, h = result["decode"], result["ring"], result["heartbeat"]
    m = result["machine"]
    print(
        f"\nB5 serving overhead: model={result['model']} device={result['device']} "
        f"cpus={m['cpu_count']} commit={m['commit'][:10]}"
    )
    print(f"{'':12} {'ttft_ms':>9} {'ms/token':>9}   ({d['tokens']} tokens, median of runs)")
    for side in ("inprocess", "served"):
        print(f"{side:12} {d[side]['ttft_ms']:9.2f} {d[side]['decode_ms_per_token']:9.4f}")
    print(
        f"added        {d['added_ttft_ms']:9.2f} {d['added_ms_per_token']:9.4f}   "
        f"served/in-process {d['ratio_served_over_inprocess']:.3f}x (median of run pairs)"
    )
    best = d["best_of_runs"]
    print(
        f"best runs    {'':9} {best['added_ms_per_token']:9.4f}   "
        f"served/in-process {best['ratio_served_over_inprocess']:.3f}x "
        f"({best['inprocess_ms_per_token']:.4f} vs {best['served_ms_per_token']:.4f} ms/token)"
    )
    lat = r["latency_us"]
    print(f"ring one-way latency p50 {lat['p50']:.1f} us, p99 {lat['p99']:.1f} us")
    late = h["lateness_ms"]
    print(f"heartbeat lateness p50 {late['p50']:.3f} ms, max {late['max']:.3f} ms")
    print(f"{'target':26} {'goal':>12} {'measured':>14}  verdict")
    for name, v in result["targets"].items():
        print(
            f"{name:26} {v['target']:>12} {v['measured']:14.4f}  {'PASS' if v['pass'] else 'FAIL'}"
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of the benchmark; `args` as parsed by `main`."""
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": getattr(args, "command", "python -m hybridgen.benchmarks.serving_overhead"),
        "model": args.model,
        "device": args.device,
        "note": "absolute times count only on the H200 machine; on small noisy machines "
        "read the served/in-process ratio (both measured in this run, alternating)",
    }
    result["decode"] = measure_decode(
        args.model, args.device, args.tokens, args.runs, args.weights_format
    )
    paced = max(100, min(2000, args.tickets // 20))
    rings = sorted(
        (measure_ring(args.tickets, paced) for _ in range(args.runs)),
        key=lambda r: r["tickets_per_s"],
    )
    result["ring"] = rings[len(rings) // 2]  # the median run by throughput
    result["ring"]["tickets_per_s_runs"] = [r["tickets_per_s"] for r in rings]
    result["heartbeat"] = measure_jitter(args.jitter_seconds)
    result["targets"] = verdicts(result)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tickets", type=int, default=200_000)
    ap.add_argument("--jitter-seconds", type=float, default=5.0)
    ap.add_argument("--weights-format", choices=("native", "int8", "int4"), default="native")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serving_overhead.json"))
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    args.command = " ".join(["python -m hybridgen.benchmarks.serving_overhead", *argv])
    if args.tokens < 2 or args.runs < 1 or args.tickets < 2 or not args.jitter_seconds > 0:
        ap.error("need --tokens >= 2, --runs >= 1, --tickets >= 2, --jitter-seconds > 0")
    hlog.configure()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log.info("results_written", path=str(args.out))
    print_table(result)
    return result


if __name__ == "__main__":
    main()
