"""The article's end-to-end benchmark (BENCHMARKS.md B6), through the real gateway.

    python -m hybridgen.benchmarks.e2e_benchmark --model llama3-8b --prompt-file prompts.jsonl \
        --batch-size 4 --max-new-tokens 128 [--compare] [--rounds N] [--config FILE] \
        [--out DIR] [--port P | --target HOST:PORT]

Starts `hybridgen serve` (or uses the server at --target), streams Generate for every prompt
of the file with --batch-size requests in flight, and reports time to first token, end-to-end
latency, tok/s and peak GPU memory. --compare runs it twice, in mode hybrid and pure_gpu,
and reports hybrid/pure_gpu ratios. --rounds N times N passes over the file back to back,
each after the first under its own head (so no pass finds another's prefix cached), and
reports the figures over all of them, with each pass's tok/s and TTFT p50 beside: one pass
of B6 (i) varies by +-10 % from run to run on the same server (bench/NOTES.md, B6). Writes
<out>/e2e.json and <out>/e2e_latency.png, and prints a table last.

Prompt file: JSON lines `{"prompt": "...", "max_new_tokens": 64}` (max_new_tokens optional,
default --max-new-tokens). Every request ignores EOS, so it generates exactly that many.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog
import yaml

from hybridgen.benchmarks.e2e_plot import (
    PERCENTILES,
    RequestResult,
    gpu_mem_peak,
    plot_latency,
    print_table,
    ratios,
    summarize,
)
from hybridgen.benchmarks.prompt_file import Prompt, load_prompts
from hybridgen.benchmarks.report import machine_info
from hybridgen.benchmarks.server_time import pass_counts, phase_seconds, run_passes, run_phases
from hybridgen.benchmarks.serving_overhead import _free_port, _wait_serving, stop_served
from hybridgen.config.file import ConfigError, load_config
from hybridgen.runtime import log as hlog

log = structlog.get_logger()

MODES = ("hybrid", "pure_gpu")
WARMUP_PROMPT = "Warm-up request {}, not timed.\n"
"""Heads the warm-up copies of the file's prompts: their lengths compile the same kernels,
and their KV shares no prefix with the timed requests."""
ROUND_PROMPT = "Timed round {}.\n"
"""Heads every prompt of a timed pass after the first: each pass computes its prompts."""


ROUND_KEYS = ("wall_s", "tok_per_s", "avg_first_token_latency_ms", "p50_first_token_latency_ms")
"""Each timed pass's figures kept beside the pooled ones (per_round)."""


class BenchmarkError(Exception):
    """A run that cannot give valid figures; the message says what to change."""


# -- arguments ------------------------------------------------------------------------------


def int_range(low: int, high: int | None = None) -> Any:
    """An argparse type: an integer in [low, high]; the error names the allowed range."""
    allowed = f"allowed {low} <= N <= {high}" if high is not None else f"allowed >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer ({allowed})") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: {allowed}")
        return value

    return parse


def _prompt_file(text: str) -> list[Prompt]:
    try:
        return load_prompts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc}") from None


def _target(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT with 1 <= PORT <= 65535")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hybridgen.benchmarks.e2e_benchmark",
        description=(__doc__ or "").splitlines()[0],
    )
    ap.add_argument("--model", default=None, help="checkpoint folder or preset (config's)")
    ap.add_argument("--prompt-file", type=_prompt_file, required=True, metavar="FILE")
    ap.add_argument("--batch-size", type=int_range(1), default=4, help="requests in flight")
    ap.add_argument("--max-new-tokens", type=int_range(1), default=128)
    ap.add_argument("--compare", action="store_true", help="hybrid vs pure_gpu mode")
    ap.add_argument("--config", type=Path, default=None, help="hybridgen_config.yaml")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument(
        "--warmup",
        type=int_range(0),
        default=1,
        help="untimed rounds of --batch-size requests (the file's prompts under another head)",
    )
    ap.add_argument(
        "--rounds",
        type=int_range(1, 20),
        default=1,
        help="timed passes over the file (each after the first under its own head)",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--out", type=Path, default=Path("bench/out/e2e"))
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--port", type=int_range(1, 65535), default=None, help="port of the server")
    where.add_argument("--target", type=_target, default=None, help="a running server")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.compare and args.target:
        ap.error("argument --compare: starts its own servers in both modes; drop --target")
    if not args.timeout > 0:
        ap.error(f"argument --timeout: {args.timeout} is out of range: allowed > 0")
    try:
        args.mode = load_config(args.config).mode
    except ConfigError as exc:
        ap.error(f"argument --config: {exc}")
    return args


# -- the server -----------------------------------------------------------------------------


def write_config(source: Path | None, mode: str, folder: Path, runtime: Path) -> Path:
    """`source` (or the defaults) in `mode`, with no metrics port and a private runtime folder.
    pure_gpu allows only GPU placements and no Warm tier, so other pins and
    kv_cache.warm_region_mb are cleared for it."""
    data: dict[str, Any] = (yaml.safe_load(source.read_text()) or {}) if source else {}
    data["mode"] = mode
    ports = {"metrics_port": 0, "http_port": 0}
    data["server"] = {**(data.get("server") or {}), **ports, "runtime_dir": str(runtime)}
    profile = data.get("profile_path")
    if source and profile and not Path(profile).is_absolute():
        data["profile_path"] = str((source.parent / profile).resolve())
    for name, value in (data.get("placements") or {}).items():
        if mode == "pure_gpu" and value not in (None, "gpu"):
            log.warning("placement_cleared", placement=name, value=value, mode=mode)
            data["placements"][name] = None
    kv_cache = data.get("kv_cache") or {}
    if mode == "pure_gpu" and kv_cache.get("warm_region_mb"):
        log.warning("warm_region_cleared", warm_region_mb=kv_cache["warm_region_mb"], mode=mode)
        kv_cache["warm_region_mb"] = None
    path = folder / "hybridgen_config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_config(path)  # the schema's error, naming the key, before a server is started
    return path


@contextlib.contextmanager
def served(
    args: argparse.Namespace, mode: str, folder: Path, report: dict[str, Any]
) -> Iterator[str]:
    """`hybridgen serve` in `mode`; yields its HOST:PORT. On exit: SIGINT (Ctrl-C's clean
    stop), and `report` gets the exit code and what was left in /dev/shm. The daemons'
    logs are copied into `folder`."""
    import grpc

    folder.mkdir(parents=True, exist_ok=True)
    runtime = Path(tempfile.mkdtemp(prefix="hg-e2e-"))  # short: unix socket paths are short
    instance, port = f"e2e{uuid.uuid4().hex[:10]}", args.port or _free_port()
    cmd = [sys.executable, "-m", "hybridgen.cli.main", "serve", "--device", args.device]
    cmd += ["--config", str(write_config(args.config, mode, folder, runtime))]
    cmd += ["--port", str(port), "--instance", instance]
    cmd += ["--model", args.model] if args.model else []
    log_path = folder / "serve.log"
    report.update(instance=instance, serve_command=" ".join(cmd[1:]))
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        log.info("serve_starting", mode=mode, port=port, log=str(log_path))
        report["serve_ready_s"] = _wait_serving(channel, proc, log_path)
        log.info("serve_ready", mode=mode, seconds=round(report["serve_ready_s"], 1))
        yield f"127.0.0.1:{port}"
    finally:
        channel.close()
        stop_served(proc, instance, report, signal.SIGINT)
        for daemon_log in (runtime / instance).glob("*.log"):
            shutil.copy(daemon_log, folder / daemon_log.name)
        shutil.rmtree(runtime, ignore_errors=True)
        log.info("serve_stopped", mode=mode, exit_code=report["serve_exit_code"])


# -- the clients ----------------------------------------------------------------------------


def one_request(stub: Any, result: RequestResult, text: str, timeout: float) -> RequestResult:
    """Stream one Generate, filling `result` with its timings or its error."""
    import grpc

    from hybridgen.v1 import generation_pb2 as pb

    rid = f"e2e-{uuid.uuid4().hex[:8]}-{result.index}"
    request = pb.GenerateRequest(
        request_id=rid,
        prompt=text,
        max_tokens=result.max_new_tokens,
        ignore_eos=True,  # every request generates exactly max_tokens: comparable work
        sampling=pb.SamplingParams(temperature=0.0),
    )
    start = time.perf_counter()
    try:
        for message in stub.Generate(request, timeout=timeout):
            if message.token_ids and result.ttft_ms is None:
                result.ttft_ms = (time.perf_counter() - start) * 1e3
            result.tokens += len(message.token_ids)
            if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                result.finish_reason = pb.FinishReason.Name(message.finish_reason)
                result.prompt_tokens = message.usage.prompt_tokens
    except grpc.RpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
        log.warning("request_failed", request_id=rid, line=result.line, error=result.error)
    result.e2e_ms = (time.perf_counter() - start) * 1e3
    return result


def check_fit(stub: Any, prompts: Sequence[Prompt], default_new: int, info: Any) -> None:
    """Every prompt plus its new tokens must fit the served context; else say which do not."""
    from hybridgen.v1 import generation_pb2 as pb

    bad = []
    for p in prompts:
        n = len(stub.Tokenize(pb.TokenizeRequest(text=p.text), timeout=60).token_ids)
        new = p.max_new_tokens or default_new
        if n + new > info.max_model_len:
            whose = "the line's max_new_tokens" if p.max_new_tokens else "--max-new-tokens"
            bad.append(f"line {p.line} ({n:,} prompt + {new} new tokens, {whose})")
    if bad:
        raise BenchmarkError(
            f"{len(bad)} prompts do not fit the served context of {info.max_model_len:,} tokens "
            f"({info.model}): {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; shorten "
            "them, lower their new tokens, use a prompt file sized for the model "
            "(bench/prompts_short.jsonl holds short ones), or serve a longer context "
            "(--max-model-len)"
        )


def warmup_jobs(prompts: Sequence[Prompt], n: int) -> list[tuple[RequestResult, str]]:
    """`n` untimed requests of 4 tokens over the file's first prompts, under another head."""
    return [
        (RequestResult(-1, 0, 4), WARMUP_PROMPT.format(i) + prompts[i % len(prompts)].text)
        for i in range(n)
    ]


def round_jobs(
    prompts: Sequence[Prompt], rnd: int, default_new: int
) -> list[tuple[RequestResult, str]]:
    """The timed requests of pass `rnd` (0 first): the file's prompts, under ROUND_PROMPT's
    head after the first pass."""
    head = ROUND_PROMPT.format(rnd) if rnd else ""
    return [
        (
            RequestResult(rnd * len(prompts) + i, p.line, p.max_new_tokens or default_new, rnd),
            head + p.text,
        )
        for i, p in enumerate(prompts)
    ]


def run_batch(
    stub: Any,
    jobs: Sequence[tuple[RequestResult, str]],
    args: argparse.Namespace,
    progress: hlog.Progress | None = None,
    done: int = 0,
) -> None:
    """Every job, with --batch-size of them in flight at once (a closed loop: a new request
    starts when one ends); `done`: requests the progress line counted before these."""
    with ThreadPoolExecutor(max_workers=args.batch_size) as pool:
        futures = [pool.submit(one_request, stub, r, text, args.timeout) for r, text in jobs]
        for n, _ in enumerate(as_completed(futures), done + 1):
            if progress is not None:
                progress.update(n)


def bench_target(target: str, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Every prompt through the server at `target`, --batch-size at a time."""
    import grpc

    from hybridgen.v1 import generation_pb2 as pb
    from hybridgen.v1 import generation_pb2_grpc as pb_grpc

    prompts: list[Prompt] = args.prompt_file
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        except grpc.RpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
            raise BenchmarkError(f"no HybridGen server answering at {target} ({why})") from exc
        check_fit(stub, prompts, args.max_new_tokens, info)
        run_batch(stub, warmup_jobs(prompts, args.warmup * args.batch_size), args)
        progress = hlog.Progress("e2e_requests_done", len(prompts) * args.rounds, unit="requests")
        first = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        before, counted = phase_seconds(first), pass_counts(first)
        results: list[RequestResult] = []
        rounds = []
        for rnd in range(args.rounds):
            jobs = round_jobs(prompts, rnd, args.max_new_tokens)
            start = time.perf_counter()
            run_batch(stub, jobs, args, progress, done=len(results))
            rounds.append(summarize([r for r, _ in jobs], time.perf_counter() - start))
            results += [r for r, _ in jobs]
        wall_s = sum(r["wall_s"] for r in rounds)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    peak, source = gpu_mem_peak(info)
    return {
        "mode": info.mode or mode,  # the server's own word, where it reports one
        "model": info.model,
        "synthetic": info.synthetic,
        "device": info.device,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        **summarize(results, wall_s),
        "rounds": args.rounds,
        "per_round": [{k: v for k, v in r.items() if k in ROUND_KEYS} for r in rounds],
        "gpu_mem_peak_mb": peak,
        "gpu_mem_peak_source": source,
        "server_time": (spent := run_phases(before, phase_seconds(info), wall_s)),
        "server_passes": run_passes(counted, pass_counts(info), spent),
        "per_request": [asdict(r) for r in results],
    }


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    if args.target:
        return {**bench_target(args.target, args, mode), "server": {"target": args.target}}
    report: dict[str, Any] = {}
    with served(args, mode, args.out / f"serve-{mode}", report) as target:
        result = bench_target(target, args, mode)
    return {**result, "server": report}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark in one mode (the config's), or in both with --compare."""
    meta = {
        "machine": machine_info(),
        "command": args.command,
        "note": "absolute times count only on the H200 machine; elsewhere read the ratios",
    }
    if not args.compare:
        mode = args.mode if not args.target or args.config else "unknown"
        return {**meta, **run_mode(args, mode)}
    modes = {mode: run_mode(args, mode) for mode in MODES}
    head = {k: modes["hybrid"][k] for k in ("model", "synthetic", "device")}
    extra = {"batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens}
    return {**meta, **head, **extra, "mode": "compare", **modes, "ratios": ratios(*modes.values())}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    args.command = " ".join(["python -m hybridgen.benchmarks.e2e_benchmark", *argv])
    hlog.configure()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args)
    except (BenchmarkError, RuntimeError, TimeoutError, ConfigError) as exc:
        log.error("e2e_benchmark_failed", error=str(exc))
        return 1
    runs = {m: result[m] for m in MODES if m in result} or {result["mode"]: result}
    json_path = args.out / "e2e.json"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    plot_path = plot_latency(runs, args.out / "e2e_latency.png", PERCENTILES)
    log.info("results_written", json=str(json_path), plot=str(plot_path))
    print_table(result, runs)
    failed = sum(r["failed"] for r in runs.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
