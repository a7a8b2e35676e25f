"""Write a multi-turn chat workload for the load client (BENCHMARKS.md B6 (iii)).

    python bench/make_chat_workload.py --conversations 48 --turns 6 --system-tokens 2048 \
        --answer-tokens 128 --context 8192 24576 --think-s 1.0 --out bench/chat_b6.json

N conversations of T turns after one shared system prompt; each conversation's context
grows to a length drawn from --context (its user tokens split over its turns). Replay it
with `python -m hybridgen.benchmarks.load --config FILE --chat bench/chat_b6.json
--concurrency 32` (conversations in flight). The format is in
benchmarks/chat_workload.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridgen.benchmarks.chat_workload import WorkloadError, dump, make
from hybridgen.benchmarks.e2e_benchmark import int_range


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--conversations", type=int_range(1), default=48)
    ap.add_argument("--turns", type=int_range(1), default=6)
    ap.add_argument("--system-tokens", type=int_range(0), default=2048)
    ap.add_argument("--answer-tokens", type=int_range(1), default=128)
    ap.add_argument(
        "--context", type=int_range(1), nargs=2, default=[8192, 24576], metavar=("LOW", "HIGH")
    )
    ap.add_argument("--think-s", type=float, default=1.0, help="mean pause before a next turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.think_s < 0:
        ap.error(f"argument --think-s: {args.think_s} is out of range: allowed >= 0")
    try:
        workload = make(
            args.conversations,
            args.turns,
            args.system_tokens,
            args.answer_tokens,
            (args.context[0], args.context[1]),
            args.think_s,
            args.seed,
        )
    except WorkloadError as exc:
        ap.error(f"argument --context: {exc}")
    dump(workload, args.out)
    contexts = [c.context(workload.system_tokens) for c in workload.conversations]
    print(
        f"{args.out}: {len(contexts)} conversations x {args.turns} turns, system prompt "
        f"{workload.system_tokens} tokens, contexts {min(contexts)}-{max(contexts)} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
