"""`hybridgen serve`: a flag for every config key (config_layers), the checks made before any
daemon starts (preflight), the three daemons under the Supervisor, and what the terminal
shows (terminal.py's progress, and the banner once serving).

The daemons read the merged configuration from `config.yaml` in the instance's runtime
folder, written here, so that flags and HYBRIDGEN_* variables reach them as the file does.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from hybridgen.cli.supervisor import ChildSpec
    from hybridgen.config.file import HybridGenConfig
    from hybridgen.config.sections import ServerConfig

__all__ = ["add_arguments", "cmd_serve", "connect_host", "runtime_dir"]

EXIT_OK, EXIT_STARTUP = 0, 2
LOOPBACK = ("127.0.0.1", "::1", "localhost")
"""Hosts only this machine reaches."""


def _err(message: str) -> None:
    print(f"hybridgen: {message}", file=sys.stderr, flush=True)


def open_exposure(server: ServerConfig) -> str | None:
    """What a non-loopback server.host leaves open (no TLS, no API keys), said at start;
    None when it binds loopback only or has both."""
    if server.host in LOOPBACK or (server.tls.enabled and server.api_key_file is not None):
        return None
    missing = []
    if not server.tls.enabled:
        missing.append("plaintext (no server.tls)")
    if server.api_key_file is None:
        missing.append("open to any caller (no server.api_key_file)")
    return (
        f"server.host {server.host} exposes the gRPC and HTTP ports {' and '.join(missing)}; "
        "set both before binding beyond 127.0.0.1 (README, TLS and API keys)"
    )


# -- flags ------------------------------------------------------------------------------------


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """serve's own flags, then one per config key, grouped by section."""
    from hybridgen.config.layers import settings

    serve.add_argument(
        "--config",
        type=Path,
        default=os.environ.get("HYBRIDGEN_CONFIG"),
        help="hybridgen_config.yaml (env HYBRIDGEN_CONFIG); flags and HYBRIDGEN_* variables "
        "override its keys",
    )
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    serve.add_argument(
        "--explain",
        action="store_true",
        help="once serving, print the op-region table: labels, placements and why",
    )
    serve.add_argument(
        "--print-config",
        action="store_true",
        help="print the merged configuration and where each value came from, and exit",
    )
    groups: dict[str, Any] = {}
    for s in settings():
        section = s.key.rsplit(".", 1)[0] if "." in s.key else "top level"
        if section not in groups:
            groups[section] = serve.add_argument_group(f"config: {section}")
        default = "null" if s.default is None else s.default
        if default == ():
            default = "none"  # an empty list
        extra: dict[str, Any] = (
            {"action": argparse.BooleanOptionalAction} if s.is_bool else {"metavar": s.metavar}
        )
        groups[section].add_argument(
            s.flag,
            dest=s.key,
            default=None,
            help=f"{s.doc} [{s.key}, {s.env}; default {default}]".replace("%", "%%"),
            **extra,
        )


def _flag_values(args: argparse.Namespace) -> dict[str, object]:
    from hybridgen.config.layers import settings

    return {s.key: getattr(args, s.key) for s in settings()}


# -- the runtime folder -----------------------------------------------------------------------


def runtime_dir(configured: str, instance: str) -> Path:
    """The per-instance folder of sockets and logs: the configured runtime_dir if we may write
    there (systemd creates /run/hybridgen), else $XDG_RUNTIME_DIR/hybridgen, else /tmp."""
    bases = _runtime_bases(configured)
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
    raise OSError(
        f"server.runtime_dir (--runtime-dir): no writable folder among {[str(b) for b in bases]}"
        "; give one this user may write"
    )


def _runtime_bases(configured: str) -> list[Path]:
    """Where runtime_dir looks, in order."""
    bases = [Path(configured)]
    if os.environ.get("XDG_RUNTIME_DIR"):
        bases.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "hybridgen")
    bases.append(Path(f"/tmp/hybridgen-{os.getuid()}"))
    return bases


def _held_elsewhere(configured: str, instance: str) -> bool:
    """Whether a live process of the instance holds its lock, said at once: checked before the
    preflight (which reads the model, seconds for a GGUF's metadata), creating nothing."""
    for base in _runtime_bases(configured):
        path = base / instance / "serve.lock"
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError:
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                continue
            except BlockingIOError:
                pass
        _still_running(path, instance)  # closed first: lock_holders must not list us
        return True
    return False


def _still_running(path: Path, instance: str) -> None:
    from hybridgen.cli.supervisor import lock_holders

    pids = " ".join(str(p) for p in lock_holders(path)) or "unknown: another user"
    _err(
        f"instance '{instance}' is still running (pids {pids}, lock {path}); stop it "
        "(kill those pids) or pick another --instance"
    )


def _lock_instance(rt: Path, instance: str) -> IO[bytes] | None:
    """An exclusive lock held while any process of the instance lives (the children inherit
    it): a second supervisor, or one started beside orphans of a killed one, would share
    their rings and ports."""
    path = rt / "serve.lock"
    f = open(path, "ab")  # noqa: SIM115 - held open for the life of the process
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        _still_running(path, instance)
        return None
    return f


def _write_config(config: HybridGenConfig, rt: Path) -> Path:
    """The merged configuration as the file the daemons read."""
    import yaml

    from hybridgen.config.layers import config_document

    path = rt / "config.yaml"
    text = "# written by hybridgen serve: the merged configuration this instance runs\n"
    path.write_text(text + yaml.safe_dump(config_document(config), sort_keys=False))
    return path


# -- the daemons ------------------------------------------------------------------------------


def connect_host(host: str) -> str:
    """Where a local client reaches a server bound to `host` (wildcards mean loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)


def child_specs(config_file: Path, device: str, rt: Path, instance: str) -> list[ChildSpec]:
    """The three processes of one instance, in start order. Each reads the merged config
    (`--instance` also shows in `ps` which instance a process serves)."""
    from hybridgen.cli.supervisor import ChildSpec

    py = sys.executable
    common = ("--config", str(config_file), "--instance", instance)
    cpu_sock = rt / "cpu.sock"
    listen = ("--listen", f"unix:{cpu_sock}")
    gateway = (py, "-m", "hybridgen.gateway.main", "--upstream", f"unix:{cpu_sock}")
    return [
        ChildSpec(
            "gpu",
            (py, "-m", "hybridgen.gpu_daemon.main", *common, "--device", device),
            log_path=rt / "gpu.log",
        ),
        ChildSpec(
            "cpu",
            (py, "-m", "hybridgen.cpu_daemon.main", *common, "--device", device, *listen),
            depends_on=("gpu",),  # the GPU daemon re-creates the rings the CPU daemon maps
            log_path=rt / "cpu.log",
            prestart=True,  # its imports (torch: ~2 s) while the GPU daemon loads
        ),
        # Not restarted with the CPU daemon: its channel to cpu.sock reconnects by itself and
        # clients meanwhile get UNAVAILABLE instead of a refused public port.
        ChildSpec(
            "gateway",
            (*gateway, "--config", str(config_file)),
            log_path=rt / "gateway.log",
            prestart=True,
        ),
    ]


# -- serve ------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from hybridgen.cli.preflight import PreflightError, preflight
    from hybridgen.config.file import ConfigError
    from hybridgen.config.layers import format_layered, layered_config, unknown_variables
    from hybridgen.runtime import log as hlog

    for line in unknown_variables(os.environ):
        _err(line)
    try:
        layered = layered_config(args.config, os.environ, _flag_values(args))
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_STARTUP
    if args.print_config:
        print(format_layered(layered), flush=True)
        return EXIT_OK
    config = layered.config
    # Only what needs the user's eye: the daemons' own logs are files in the runtime folder.
    hlog.configure(json=False, level=os.environ.get("HYBRIDGEN_LOG_LEVEL", "warning"))
    if _held_elsewhere(config.server.runtime_dir, config.server.instance):
        return EXIT_STARTUP
    try:
        preflight(config, args.device, config.server.instance)
        rt = runtime_dir(config.server.runtime_dir, config.server.instance)
    except (PreflightError, OSError) as exc:
        _err(str(exc))
        return EXIT_STARTUP
    lock = _lock_instance(rt, config.server.instance)
    if lock is None:
        return EXIT_STARTUP
    exposure = open_exposure(config.server)
    if exposure is not None:
        _err(f"warning: {exposure}")
    with lock:
        return _supervise(config, _write_config(config, rt), args, rt, lock)


def _supervise(
    config: HybridGenConfig, config_file: Path, args: argparse.Namespace, rt: Path, lock: IO[bytes]
) -> int:
    from hybridgen.cli.supervisor import Policy, Supervisor
    from hybridgen.cli.terminal import Terminal
    from hybridgen.ipc.shm import unlink_all

    terminal = Terminal()
    announced: list[bool] = []

    def announce() -> None:
        terminal.close()
        host, port = connect_host(config.server.host), config.server.port
        if announced:  # every child is ready again after a restart
            print(f"HybridGen is serving again on {host}:{port}", flush=True)
            return
        announced.append(True)
        print(banner(config, rt, _model_info(config)), flush=True)
        if args.explain:
            _print_regions(config)

    instance = config.server.instance
    terminal.line(f"instance {instance}: model {config.model.name_or_path}, logs in {rt}")
    supervisor = Supervisor(
        child_specs(config_file, args.device, rt, instance),
        rt,
        Policy(progress_every_s=5.0),
        report=terminal.line,
        on_all_ready=announce,
        inherit_fds=(lock.fileno(),),
        on_status=terminal.status,
    )
    status = supervisor.run()
    terminal.close()
    # After SIGKILLs the GPU daemon could not clean up; a clean stop leaves nothing.
    removed = unlink_all(instance)
    if removed:
        _err(f"removed {len(removed)} leftover shared-memory objects")
    return status


# -- once serving -----------------------------------------------------------------------------


def _model_info(config: HybridGenConfig) -> Any:
    """The served model's GetModelInfo, or None if it does not answer. Behind TLS the
    server's own certificate is the trusted root (a self-signed one, as the README makes) and
    the call goes to the name it carries; with API keys it sends the file's first key. With
    mutual TLS (no client certificate here) it is not asked."""
    import grpc

    from hybridgen.serving.auth import read_keys
    from hybridgen.v1 import generation_pb2 as pb
    from hybridgen.v1 import generation_pb2_grpc as pb_grpc

    srv = config.server
    if srv.tls.client_ca_file is not None:
        return None
    host = _tls_host(connect_host(srv.host)) if srv.tls.enabled else connect_host(srv.host)
    target = f"{host}:{srv.port}"
    metadata = None
    try:
        if srv.api_key_file is not None:  # the file was checked at start: it has a key
            metadata = [("authorization", f"Bearer {read_keys(srv.api_key_file)[0]}")]
        if srv.tls.enabled:
            assert srv.tls.cert_file is not None
            root = Path(srv.tls.cert_file).read_bytes()
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root))
        else:
            channel = grpc.insecure_channel(target)
        with channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=metadata)
    except grpc.RpcError as exc:
        _err(f"GetModelInfo failed: {exc.code().name}")
    except (OSError, UnicodeDecodeError, IndexError) as exc:
        _err(f"GetModelInfo not asked: {exc!r}")
    return None


def _tls_host(host: str) -> str:
    """Where a local client reaches a TLS server: a certificate names a host (the README's:
    localhost), not a loopback address."""
    return "localhost" if host in ("127.0.0.1", "[::1]") else host


def banner(config: HybridGenConfig, rt: Path, info: Any) -> str:
    """What is served, where, and how to try it."""
    from hybridgen.cli.supervisor import Policy
    from hybridgen.models.default_model import shown_name

    srv = config.server
    host = connect_host(srv.host)
    name = shown_name(info.model if info is not None else config.model.name_or_path)
    lines = [f"HybridGen is serving {name} on {host}:{srv.port} (gRPC)"]
    if info is not None:
        what = (
            "a synthetic preset: seeded random weights, so its text is noise"
            if info.synthetic
            else f"{info.architecture}, {info.dtype}"
        )
        lines.append(f"  model    {what}")
        lines.append(
            f"  engine   {info.mode} mode on {info.device}, context {info.max_model_len:,} "
            f"tokens, up to {info.max_num_seqs} sequences"
        )
    scheme = "https" if srv.tls.enabled else "http"
    if srv.tls.enabled:
        host = _tls_host(host)
    if srv.http_port:
        lines.append(f"  OpenAI   {scheme}://{host}:{srv.http_port}/v1")
    if srv.metrics_port:
        lines.append(
            f"  metrics  http://{connect_host(srv.metrics_host)}:{srv.metrics_port}/metrics"
        )
    lines.append(f"  logs     {rt}/{{gpu,cpu,gateway}}.log")
    lines.append(f"  try      {_try_it(config, host, scheme)}")
    drain = f"running requests get {Policy().drain_s:g} s to finish; Ctrl-C again: at once"
    lines.append(f"  stop     Ctrl-C ({drain})")
    return "\n".join(lines)


def _try_it(config: HybridGenConfig, host: str, scheme: str) -> str:
    """A command that talks to this server as configured: `hybridgen generate` (plaintext,
    no key), else curl with the certificate and a key, else grpcurl's health check."""
    srv = config.server
    if not srv.tls.enabled and srv.api_key_file is None:
        return f'{invoked_as()} generate --port {srv.port} "Hello"'
    opts = f"--cacert {srv.tls.cert_file} " if srv.tls.enabled else ""
    if srv.api_key_file is not None:
        opts += f'-H "Authorization: Bearer $(head -1 {srv.api_key_file})" '
    if srv.http_port:
        return f"curl {opts}{scheme}://{host}:{srv.http_port}/v1/models"
    tls = f"-cacert {srv.tls.cert_file}" if srv.tls.enabled else "-plaintext"
    return f"grpcurl {tls} {host}:{srv.port} grpc.health.v1.Health/Check"


def invoked_as(argv0: str | None = None) -> str:
    """How the user's shell runs this hybridgen: `hybridgen` where PATH finds this very
    script (or it was not started as one: python -m), else the path it was started by, e.g.
    .venv/bin/hybridgen when the venv is not activated."""
    me = Path(argv0 if argv0 is not None else sys.argv[0])
    if me.name != "hybridgen":
        return "hybridgen"
    found = shutil.which("hybridgen")
    return "hybridgen" if found and Path(found).resolve() == me.resolve() else str(me)


def _print_regions(config: HybridGenConfig) -> None:
    """The served engine's op-region table (GetModelInfo.op_regions), as text."""
    from hybridgen.cli.explain import layer_lines, prefix_lines, spill_lines
    from hybridgen.placement.op_regions import Label, Region, Scope, format_table

    info = _model_info(config)
    if info is None:
        return
    rows = [
        Region(
            r.name,
            cast(Scope, r.scope),
            cast(Label, r.label),
            r.placement,
            r.source,
            dict(r.measured),
        )
        for r in info.op_regions
    ]
    print(f"op-regions of {info.model} ({info.mode} mode, {info.device}):", flush=True)
    print(format_table(rows), flush=True)
    print("\n".join([*spill_lines(info), *prefix_lines(info), *layer_lines(info)]), flush=True)
