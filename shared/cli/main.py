"""The `hybridgen` command: serve, generate, config-check.

    hybridgen serve [--model PATH|PRESET] [--config hybridgen_config.yaml] [--port N]
    hybridgen generate "Hello" [--port 50051] [--max-tokens 64] [--temperature 0.7]
    hybridgen config-check hybridgen_config.yaml

Heavy imports (torch through the config schema, grpc) happen inside the subcommands, so
`--help` and `generate` start quickly.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import stat
import sys
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

if TYPE_CHECKING:
    import grpc

    from hybridgen.cli.supervisor import ChildSpec
    from hybridgen.config import HybridGenConfig

__all__ = ["main", "runtime_dir"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _err(message: str) -> None:
    print(f"hybridgen: {message}", file=sys.stderr, flush=True)


# -- config-check -----------------------------------------------------------------------------


def cmd_config_check(args: argparse.Namespace) -> int:
    from hybridgen.config import ConfigError, load_config

    try:
        config = load_config(args.file)
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_USAGE
    print(f"OK: {args.file} (model {config.model.name_or_path}, instance {config.server.instance})")
    return EXIT_OK


# -- serve ------------------------------------------------------------------------------------


def runtime_dir(configured: str, instance: str) -> Path:
    """The per-instance folder of sockets and logs: the configured runtime_dir if we may write
    there (systemd creates /run/hybridgen), else $XDG_RUNTIME_DIR/hybridgen, else /tmp."""
    bases = [Path(configured)]
    if os.environ.get("XDG_RUNTIME_DIR"):
        bases.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "hybridgen")
    bases.append(Path(f"/tmp/hybridgen-{os.getuid()}"))
    for base in bases:
        path = base / instance
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
            st = path.lstat()
        except OSError:
            continue
        # In a shared /tmp, someone else's folder (or a planted symlink) must not be used.
        mine = st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode)  # lstat: no symlink
        if mine and os.access(path, os.W_OK | os.X_OK):
            return path
    raise OSError(f"no writable runtime folder among {[str(b) for b in bases]}")


def _connect_host(host: str) -> str:
    """Where a local client reaches a server bound to `host` (wildcards mean loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)


def child_specs(config: HybridGenConfig, args: argparse.Namespace, rt: Path) -> list[ChildSpec]:
    """The three processes of one instance, in start order."""
    from hybridgen.cli.supervisor import ChildSpec

    py = sys.executable
    config_flag = [] if args.config is None else ["--config", str(args.config)]
    common = ["--model", args.model, "--instance", args.instance, *config_flag]
    cpu_sock = rt / "cpu.sock"
    gateway = (
        *(py, "-m", "hybridgen.gateway.main", "--upstream", f"unix:{cpu_sock}"),
        *("--port", str(args.port), *config_flag),
    )
    return [
        ChildSpec(
            "gpu",
            (py, "-m", "hybridgen.gpu_daemon.main", *common, "--device", args.device),
            log_path=rt / "gpu.log",
        ),
        ChildSpec(
            "cpu",
            (py, "-m", "hybridgen.cpu_daemon.main", *common, "--listen", f"unix:{cpu_sock}"),
            depends_on=("gpu",),  # the GPU daemon re-creates the rings the CPU daemon maps
            log_path=rt / "cpu.log",
        ),
        # Not restarted with the CPU daemon: its channel to cpu.sock reconnects by itself and
        # clients meanwhile get UNAVAILABLE instead of a refused public port.
        ChildSpec("gateway", gateway, log_path=rt / "gateway.log"),
    ]


def _lock_instance(rt: Path, instance: str) -> IO[bytes] | None:
    """An exclusive lock held while any process of the instance lives (the children inherit
    it): a second supervisor, or one started beside orphans of a killed one, would share
    their rings and ports."""
    from hybridgen.cli.supervisor import lock_holders

    path = rt / "serve.lock"
    f = open(path, "ab")  # noqa: SIM115 - held open for the life of the process
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        pids = " ".join(str(p) for p in lock_holders(path)) or "unknown: another user"
        _err(
            f"instance '{instance}' is still running (pids {pids}, lock {path}); stop it "
            "(kill those pids) or pick another --instance"
        )
        return None
    return f


def cmd_serve(args: argparse.Namespace) -> int:
    from hybridgen.cli.supervisor import Policy, Supervisor
    from hybridgen.config import ConfigError, load_config
    from hybridgen.ipc.shm import unlink_all

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_USAGE
    args.model = args.model or config.model.name_or_path
    args.instance = args.instance or config.server.instance
    args.port = args.port if args.port is not None else config.server.port
    # Checked here, not by a daemon: the name also becomes a folder and /dev/shm names.
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", args.instance) or not 0 < args.port < 65536:
        _err(f"--instance {args.instance!r} (1-32 of [A-Za-z0-9_-]) or --port {args.port} bad")
        return EXIT_USAGE
    try:
        rt = runtime_dir(config.server.runtime_dir, args.instance)
    except OSError as exc:
        _err(str(exc))
        return EXIT_FAILURE
    lock = _lock_instance(rt, args.instance)
    if lock is None:
        return EXIT_USAGE
    host = _connect_host(config.server.host)

    announced: list[bool] = []

    def announce() -> None:
        if announced:  # every child is ready again after a restart
            print(f"HybridGen is serving again on {host}:{args.port}", flush=True)
            return
        announced.append(True)
        metrics = config.server.metrics_port
        print(f"HybridGen is serving {args.model} on {host}:{args.port}", flush=True)
        if metrics:
            print(f"  metrics: http://{host}:{metrics}/metrics", flush=True)
        if config.server.http_port:
            print(f"  OpenAI API: http://{host}:{config.server.http_port}/v1", flush=True)
        print(f'  try: hybridgen generate --port {args.port} "Hello"   (Ctrl-C stops)', flush=True)
        if args.explain:
            _print_regions(host, args.port)

    _err(f"instance {args.instance}: model {args.model}, runtime folder {rt} (logs there)")
    supervisor = Supervisor(
        child_specs(config, args, rt),
        rt,
        Policy(progress_every_s=5.0),
        report=_err,
        on_all_ready=announce,
        inherit_fds=(lock.fileno(),),
    )
    with lock:
        status = supervisor.run()
        # After SIGKILLs the GPU daemon could not clean up; a clean stop leaves nothing.
        removed = unlink_all(args.instance)
    if removed:
        _err(f"removed {len(removed)} leftover shared-memory objects")
    return status


def _print_regions(host: str, port: int) -> None:
    """The served engine's op-region table (GetModelInfo.op_regions), as text."""
    import grpc

    from hybridgen.op_regions import Label, Region, Scope, format_table
    from hybridgen.v1 import generation_pb2 as pb
    from hybridgen.v1 import generation_pb2_grpc as pb_grpc

    try:
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    except grpc.RpcError as exc:
        _err(f"--explain: GetModelInfo failed: {exc.code().name}")
        return
    rows = [
        Region(r.name, cast(Scope, r.scope), cast(Label, r.label), r.placement, r.source,
               dict(r.measured))
        for r in info.op_regions
    ]  # fmt: skip
    print(f"op-regions of {info.model} ({info.mode} mode, {info.device}):", flush=True)
    print(format_table(rows), flush=True)


# -- generate ---------------------------------------------------------------------------------


def _request(args: argparse.Namespace) -> object:
    from hybridgen.v1 import generation_pb2 as pb

    sampling = pb.SamplingParams(temperature=args.temperature, top_p=args.top_p)
    if args.seed is not None:
        sampling.seed = args.seed
    request = pb.GenerateRequest(
        request_id=f"cli-{uuid.uuid4().hex[:12]}",
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=args.stop,
    )
    if args.chat:  # the server applies the model's chat template
        request.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    return request


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from hybridgen.v1 import generation_pb2 as pb
    from hybridgen.v1 import generation_pb2_grpc as pb_grpc

    target = f"{_connect_host(args.host)}:{args.port}"
    last = None
    wrote = False
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            for last in stub.Generate(_request(args), wait_for_ready=False):
                sys.stdout.write(last.text)
                sys.stdout.flush()
                wrote = wrote or bool(last.text)
        except grpc.RpcError as exc:
            if wrote:  # end the partial line so the error starts on its own
                print(flush=True)
            return _rpc_failed(exc, target)
        except (ValueError, OSError) as exc:
            _err(str(exc))
            return EXIT_USAGE
        except KeyboardInterrupt:  # leaving the stream cancels the request on the server
            _err("cancelled")
            return 130
    print(flush=True)
    if last is not None:
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        usage = last.usage
        _err(
            f"finish_reason={reason} prompt_tokens={usage.prompt_tokens} "
            f"completion_tokens={usage.completion_tokens}"
        )
    return EXIT_OK


def _rpc_failed(exc: grpc.RpcError, target: str) -> int:
    import grpc

    code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
    details: str = exc.details() or ""  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAVAILABLE:
        _err(f"no HybridGen server answering at {target} ({details}); start one: hybridgen serve")
        return EXIT_UNAVAILABLE
    _err(f"request failed: {code.name}: {details}")
    return EXIT_USAGE if code == grpc.StatusCode.INVALID_ARGUMENT else EXIT_FAILURE


# -- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybridgen", description="HybridGen LLM inference server")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="start and supervise the GPU, CPU and gateway processes")
    serve.add_argument("--model", default=None, help="checkpoint folder or preset (config's)")
    serve.add_argument("--config", type=Path, default=None, help="hybridgen_config.yaml")
    serve.add_argument("--port", type=int, default=None, help="gRPC port (config: server.port)")
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    serve.add_argument("--instance", default=None, help="name of this server (server.instance)")
    serve.add_argument(
        "--explain",
        action="store_true",
        help="once serving, print the op-region table: labels, placements and why",
    )
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt")
    gen.add_argument("--host", default="127.0.0.1")
    gen.add_argument("--port", type=int, default=50051)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="repeatable")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message: the server applies the model's chat template",
    )
    gen.set_defaults(func=cmd_generate)

    check = sub.add_parser("config-check", help="validate a hybridgen_config.yaml")
    check.add_argument("file", type=Path)
    check.set_defaults(func=cmd_config_check)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with contextlib.suppress(BrokenPipeError):  # `hybridgen generate ... | head`
        return int(args.func(args))
    return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
