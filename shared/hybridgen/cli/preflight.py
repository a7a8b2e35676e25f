"""What `hybridgen serve` checks before it starts any daemon, so that a mistake ends it in a
second with one line naming the problem and the fix, instead of a daemon failing to start:
the model (a checkpoint folder or a preset, with "did you mean"), every port the server
listens on (free, and distinct), and the budgets (the weights against the device budget, the
host tiers against RAM and /dev/shm). The runtime folder and the instance lock are taken by
serve itself. A daemon finds the same errors, too late (hybridgen.runtime.startup_error)."""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridgen.config.engine import ConfigError
from hybridgen.config.file import HybridGenConfig
from hybridgen.config.layers import flag_for

if TYPE_CHECKING:
    from hybridgen.models.spec import ModelSpec

# The model and budget checks import the model code (a second or two on a CPU) inside their
# functions, so that a port in use is reported before that.

__all__ = ["PreflightError", "check_model", "check_ports", "preflight", "server_ports"]


class PreflightError(Exception):
    """A start-up error found before any daemon started: the problem and the fix, one line."""


def _named(key: str) -> str:
    """A dotted key and its flag: `server.metrics_port (--metrics-port)`."""
    return f"{key} ({flag_for(key)})"


def preflight(config: HybridGenConfig, device: str, instance: str) -> None:
    """Every check, cheapest first; PreflightError on the first that fails."""
    check_ports(config)
    spec = check_model(config)
    check_budget(config, device, instance, spec)


# -- the model --------------------------------------------------------------------------------


def check_model(config: HybridGenConfig) -> ModelSpec:
    """The model's shape and tokenizer, read as the daemons will read them."""
    from hybridgen.models.errors import ModelLoadError, bad_model_path

    name = config.model.name_or_path
    path_error = bad_model_path(name)  # before the model code's imports: a second or two
    if path_error is not None:
        raise PreflightError(str(path_error))
    from hybridgen.models.loader import model_spec
    from hybridgen.models.tokenizer_source import load_tokenizer

    try:
        spec = model_spec(name)
        load_tokenizer(name)
    except ModelLoadError as exc:
        raise PreflightError(str(exc)) from exc
    return spec


# -- ports ------------------------------------------------------------------------------------


def server_ports(config: HybridGenConfig) -> list[tuple[str, str, int]]:
    """(dotted key, host, port) of every port the server listens on: server.port and each
    server.<x>_port set (0 is none), on server.<x>_host where that key exists."""
    srv, found = config.server, []
    for f in dataclasses.fields(srv):
        if f.name != "port" and not f.name.endswith("_port"):
            continue
        port = getattr(srv, f.name)
        if port:
            host = getattr(srv, f.name.removesuffix("port") + "host", srv.host)
            found.append((f"server.{f.name}", host, port))
    return found


def check_ports(config: HybridGenConfig) -> None:
    """Each port distinct and free to bind on its host; every port that is not, in one
    error (each with a free port to use instead, none suggested twice)."""
    ports = server_ports(config)
    for i, (key, _, port) in enumerate(ports):
        for other, _, taken in ports[:i]:
            if port == taken:
                raise PreflightError(
                    f"{key} {port} is {other}'s port too; give each its own: {flag_for(key)} N"
                )
    avoid = {port for _, _, port in ports}  # grows with each suggestion
    problems = []
    for key, host, port in ports:
        try:
            _check_bind(key, host, port, avoid)
        except PreflightError as exc:
            problems.append(str(exc))
    if len(problems) > 1:
        raise PreflightError(f"{len(problems)} ports cannot be used: " + "; ".join(problems))
    if problems:
        raise PreflightError(problems[0])


def _check_bind(key: str, host: str, port: int, avoid: set[int]) -> None:
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PreflightError(
            f"{_named('server.host')}={host!r}: {exc.strerror}; give a name or address of this "
            "machine, such as 127.0.0.1 or 0.0.0.0"
        ) from exc
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            # As the servers bind: a port in TIME_WAIT is free, one that anyone (even with
            # SO_REUSEPORT, as a gRPC server binds) listens on is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise PreflightError(_bind_problem(key, host, port, exc, avoid)) from exc


def _bind_problem(key: str, host: str, port: int, exc: OSError, avoid: set[int]) -> str:
    flag = flag_for(key)
    if exc.errno == errno.EADDRINUSE:
        holder = _holder(port)
        by = f" by {holder}" if holder else " by another program"
        free = _free_port_near(host, port, avoid)
        return f"{key} {port} is in use on {host}{by}; stop it, or pick a free port: {flag} {free}"
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"{_named('server.host')}={host!r} is not an address of this machine; use 127.0.0.1, "
            "0.0.0.0 or one of its own addresses"
        )
    if exc.errno == errno.EACCES:
        return f"{key} {port}: ports below 1024 need root; pick one above 1023: {flag} N"
    return f"{key} {port}: cannot listen on {host}:{port}: {exc.strerror or exc} ({flag})"


def _free_port_near(host: str, port: int, avoid: set[int]) -> str:
    """The next port above `port` free on `host` and not in `avoid` (which takes it), as a
    flag value; an example if none is."""
    for candidate in range(port + 1, min(port + 50, 65536)):
        if candidate in avoid:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, candidate))
            except OSError:
                continue
        avoid.add(candidate)
        return str(candidate)
    return "N"  # none near: the flag with a placeholder


def _holder(port: int) -> str | None:
    """'pid P (command)' of the process listening on TCP `port`, when /proc shows it (our
    own processes, or all of them as root)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{inode}]")
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                words = argv.split("\0")
                command = " ".join([Path(words[0]).name, *words[1:4]])
                return f"pid {pid} ({' '.join(command.split())[:60]})"  # one line, short
        except OSError:
            continue  # gone, or not ours
    return None


# -- budgets ----------------------------------------------------------------------------------


def check_budget(config: HybridGenConfig, device: str, instance: str, spec: ModelSpec) -> None:
    """The host tiers against RAM and /dev/shm, and the device weights against the budget.
    `device`: serve's --device (auto: CUDA if there is one; no CUDA context is made here,
    which would hold device memory for the life of serve)."""
    from hybridgen.engine.host_memory import check_host_budget
    from hybridgen.engine.memory import CPU_BUDGET_MB, MIB, BudgetTooSmall, budget_bytes

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    try:
        engine = dataclasses.replace(config.engine_config("cpu"), shm_instance=instance)
        check_host_budget(engine, spec)
    except (ConfigError, BudgetTooSmall) as exc:
        raise PreflightError(str(exc)) from exc
    asked = config.device_topology.gpu.memory_mb
    if cuda and asked is None:
        return  # 90 % of what is free when the GPU daemon starts
    if cuda:
        assert asked is not None
        budget = asked * MIB
    else:
        budget = budget_bytes(engine, torch.device("cpu"))
    dtype = _weights_dtype(config, spec, cuda)
    weights = _device_weights_bytes(dataclasses.replace(spec, dtype=dtype), config)
    if weights > budget:
        key = _named("device_topology.gpu.memory_mb")
        where = f"{key}={asked}" if asked is not None else f"{key} unset, {CPU_BUDGET_MB}"
        if budget < (asked or CPU_BUDGET_MB) * MIB:
            where += f" (capped at {budget // MIB:,} MiB: the host's available memory)"
        mib, dtype_name = round(weights / MIB), str(dtype).removeprefix("torch.")
        raise PreflightError(
            f"the budget ({where}) cannot hold the weights of {spec.name}: {mib:,} MiB in "
            f"{dtype_name}, before any KV cache; raise --gpu-memory-mb, or serve a smaller model"
        )


def _weights_dtype(config: HybridGenConfig, spec: ModelSpec, cuda: bool) -> torch.dtype:
    """The dtype the loader gives the weights (models/loader.load_model)."""
    if config.model.dtype != "auto":
        return getattr(torch, config.model.dtype)  # type: ignore[no-any-return]
    if Path(config.model.name_or_path).is_dir() or cuda:
        return spec.dtype
    return torch.float32  # a preset on the CPU


def _device_weights_bytes(spec: ModelSpec, config: HybridGenConfig) -> int:
    """The least the device must hold of the weights: with Cold-Weights the experts live in
    host memory; with weights.gpu_layers only the first N decoder layers (auto: as few as
    none) stay, and an untied embedding leaves; weights.format int8 / int4 projections count
    a byte / half a byte a weight (their scales left out: a lower bound, never refusing what
    the engine would run)."""
    from hybridgen.models.presets import parameters

    cold = config.cold_weights.expert_cache_slots is not None
    keep, fmt = config.weights.gpu_layers, config.weights.format
    per_weight = {"native": float(spec.dtype.itemsize), "int8": 1.0, "int4": 0.5}[fmt]
    total = 0.0
    for name, count in parameters(spec):
        if cold and ".experts." in name:
            continue
        parts = name.split(".")
        layer = int(parts[1]) if parts[0] == "layers" else None
        if layer is not None and keep is not None and (keep == "auto" or layer >= keep):
            continue
        if keep is not None and name == "embed_tokens.weight" and not spec.tie_word_embeddings:
            continue  # host layers take the embedding to host memory (host_layer_setup.py)
        projection = layer is not None and name.endswith("_proj.weight")
        head = name == "lm_head.weight" and not spec.tie_word_embeddings
        quantized = ".experts." not in name and (projection or head)
        total += count * (per_weight if quantized else spec.dtype.itemsize)
    return int(total)
