"""A worker rank of tensor parallel (started by launch.py, never by hand):

    python -m hybridgen.parallel.worker '{"model": ..., "rank": 1, "ranks": 2, ...}'

Loads its shard, tells rank 0 it is ready, joins the process group and runs what rank 0
sends (step.py) until told to stop; any failure exits non-zero, which rank 0 sees.
"""

from __future__ import annotations

import json
import sys

import structlog
import torch
import torch.distributed as dist

from hybridgen.engine.model_runner import _allocate_kv
from hybridgen.kernels import ops
from hybridgen.parallel import step
from hybridgen.parallel.launch import GROUP_TIMEOUT, WorkerArgs
from hybridgen.parallel.model import ShardedCausalLM
from hybridgen.parallel.shard_loader import load_shard
from hybridgen.runtime import log as hlog

log = structlog.get_logger()


def main(argv: list[str] | None = None) -> int:
    args = WorkerArgs(**json.loads((argv or sys.argv[1:])[0]))
    hlog.configure(json=True)
    structlog.contextvars.bind_contextvars(process="tp_worker", rank=args.rank)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        store = dist.TCPStore(
            "127.0.0.1", args.port, args.ranks, is_master=False, timeout=GROUP_TIMEOUT
        )
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        net = load_shard(args.model, device, dtype, args.rank, args.ranks, args.seed)
        store.set(f"ready{args.rank}", "1")
        dist.init_process_group(
            args.backend, store=store, rank=args.rank, world_size=args.ranks, timeout=GROUP_TIMEOUT
        )
        log.info("tensor_parallel_worker_ready", device=str(device))
        serve(net, device)
    except Exception as exc:
        log.error("tensor_parallel_worker_failed", error=f"{type(exc).__name__}: {exc}")
        return 1
    dist.destroy_process_group()
    return 0


@torch.inference_mode()
def serve(net: ShardedCausalLM, device: torch.device) -> None:
    """Run rank 0's messages until `stop`."""
    kv: list[ops.KvCache] = []
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    while True:
        message = step.receive(device)
        if message.kind == "stop":
            return
        if message.kind == "kv":
            num_blocks, block_size = message.args
            kv = []  # the old pool goes before the new one is allocated
            kv = _allocate_kv(net.spec, num_blocks, block_size, device, "native")
            rope = (message.tensors[0], message.tensors[1])
        elif message.kind == "forward":
            assert rope is not None, "a forward before its KV pool"
            net(*step.forward_inputs(message), kv, rope)
        else:
            net.compute_logits(message.tensors[0])


if __name__ == "__main__":
    sys.exit(main())
