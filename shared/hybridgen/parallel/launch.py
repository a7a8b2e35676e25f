"""Rank 0's side of tensor parallel: start the worker ranks, join them in one process group
and load rank 0's shard; stop them again.

The workers are `python -m hybridgen.parallel.worker` processes (killed with their parent:
runtime/tied_child.py), each told its rank, device and the loopback port of rank 0's TCPStore.
Rank 0 waits for every worker's weights (each sets `ready<rank>` in the store) while
checking that they still run, so that a worker that fails to start fails the start, never
hangs it; then all build the process group: NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.models.default_model import resolve_model
from hybridgen.models.generation_config import GenerationDefaults, load_generation_defaults
from hybridgen.models.loader import LoadedModel
from hybridgen.models.tokenizer_source import load_tokenizer
from hybridgen.parallel import step
from hybridgen.parallel.model import RankLost, ShardedCausalLM
from hybridgen.parallel.shard_loader import full_spec, load_shard
from hybridgen.parallel.sharding import TP_KEY, local_spec
from hybridgen.runtime.tied_child import tied

log = structlog.get_logger()

GROUP_TIMEOUT = timedelta(days=30)
"""Collective timeout: workers wait in a broadcast for as long as the server is idle; a dead
rank is found by its closed connections and by Workers.check, not by this."""
STOP_WAIT_S = 10.0
"""How long a stopped worker may take to exit before it is killed."""
EXIT_POLL_S = 0.01
"""How often Workers.check looks again while it waits for an exit."""


@dataclass(frozen=True)
class WorkerArgs:
    """What one worker is told (as JSON on its command line)."""

    model: str
    dtype: str
    device: str
    rank: int
    ranks: int
    port: int
    backend: str
    seed: int


class Workers:
    """The worker processes of rank 0's group."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs

    def check(self, wait_s: float = 0.0) -> None:
        """RankLost when a worker has exited, or exits within `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            self._check_now()
            if time.monotonic() >= deadline:
                return
            time.sleep(EXIT_POLL_S)

    def _check_now(self) -> None:
        for rank, proc in enumerate(self.procs, 1):
            code = proc.poll()
            if code is not None:
                log.error("tensor_parallel_rank_lost", rank=rank, pid=proc.pid, exit_code=code)
                raise RankLost(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}; "
                    "the engine stops (its supervisor restarts the daemon)"
                )

    def stop(self) -> None:
        """Wait for the workers to exit (told to already), killing any that do not."""
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def worker_device(config: EngineConfig, rank: int) -> str:
    """The device of rank `rank`: the CPU for a CPU engine, else its CUDA id."""
    if config.torch_device().type != "cuda":
        return "cpu"
    ids = config.tensor_parallel_ids or tuple(range(config.tensor_parallel))
    return f"cuda:{ids[rank]}"


def start(config: EngineConfig) -> LoadedModel:
    """Rank 0's shard of config.model, its workers started and joined."""
    if dist.is_initialized():
        raise ConfigError(
            f"{TP_KEY}: this process already drives a tensor-parallel engine; release() it "
            "first (one per process)"
        )
    ranks, device = config.tensor_parallel, config.torch_device()
    model = resolve_model(config.model)
    local_spec(full_spec(model, device, config.torch_dtype()), ranks)  # fails before spawning
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's object broadcasts use the current device
    store = dist.TCPStore(
        "127.0.0.1", 0, ranks, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False
    )
    args = [
        WorkerArgs(
            model,
            config.dtype,
            worker_device(config, r),
            r,
            ranks,
            store.port,
            backend,
            config.seed,
        )
        for r in range(1, ranks)
    ]
    workers = Workers([_spawn(a) for a in args])
    try:
        net = load_shard(model, device, config.torch_dtype(), 0, ranks, config.seed)
        _wait_ready(store, workers, ranks)
        dist.init_process_group(
            backend, store=store, rank=0, world_size=ranks, timeout=GROUP_TIMEOUT
        )
    except BaseException:
        for proc in workers.procs:
            proc.kill()
        workers.stop()
        raise
    net.driver = workers
    atexit.register(_stop_at_exit, weakref.ref(net))
    log.info(
        "tensor_parallel_started",
        ranks=ranks,
        backend=backend,
        workers=[p.pid for p in workers.procs],
    )
    return LoadedModel(net, net.full, load_tokenizer(model), _generation(model, net))


def stop(net: ShardedCausalLM) -> None:
    """Tell rank 0's workers to stop, wait for them and leave the process group."""
    workers = net.driver
    if not isinstance(workers, Workers):
        return
    net.driver = None
    try:
        workers.check()
        step.send("stop", (), [])
    except Exception as exc:  # a worker gone already: the others are killed below
        log.warning("tensor_parallel_stop_failed", error=str(exc))
        for proc in workers.procs:
            proc.kill()
    workers.stop()
    dist.destroy_process_group()
    log.info("tensor_parallel_stopped")


def _stop_at_exit(ref: weakref.ref[ShardedCausalLM]) -> None:
    """At interpreter exit (a daemon's), the workers of a model still driving them."""
    net = ref()
    if net is not None:
        stop(net)


def _generation(model: str, net: ShardedCausalLM) -> GenerationDefaults:
    """EOS and BOS as load_model finds them."""
    path = Path(model)
    if path.is_dir():
        return load_generation_defaults(path, load_tokenizer(model).eos_token_id)
    return GenerationDefaults(
        eos_token_ids=net.full.eos_token_ids, bos_token_id=net.full.bos_token_id
    )


def _spawn(args: WorkerArgs) -> subprocess.Popen[bytes]:
    """A worker, without NOTIFY_SOCKET: only rank 0 reports to the supervisor."""
    cmd = [sys.executable, "-m", "hybridgen.parallel.worker", json.dumps(args.__dict__)]
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    return subprocess.Popen(tied(cmd, os.getpid()), env=env)


def _wait_ready(store: dist.TCPStore, workers: Workers, ranks: int) -> None:
    """Until every worker has loaded its shard; RankLost if one exits first."""
    keys = [f"ready{r}" for r in range(1, ranks)]
    while not store.check(keys):
        workers.check()
        time.sleep(0.05)
