"""Scheduler behaviour with a fake runner: budgets, FCFS, chunked prefill, preemption."""

from __future__ import annotations

import random

from hybridgen.engine.block_pool import BlockPool
from hybridgen.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from hybridgen.engine.sequence import Sequence, Status
from hybridgen.sampling.params import SamplingParams


def make_seq(i: int, prompt_len: int, max_tokens: int) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(f"r{i}", prompt_len, list(range(prompt_len)), params, 0, i)


def fake_step(sched: Scheduler, batch: ScheduledBatch, max_len: int) -> list[Sequence]:
    """What the engine does after the runner: advance, sample a token, finish."""
    finished = []
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        # The KV being written must fit in the sequence's blocks.
        assert sched.pool.blocks_for(seq.num_computed_tokens + n) <= len(seq.block_ids)
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append(seq.num_tokens % 97, max_len)
            if seq.finish_reason is not None:
                sched.finish(seq)
                finished.append(seq)
    return finished


def run_to_end(sched: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> list:
    done: list[Sequence] = []
    steps = []
    for _ in range(max_steps):
        if not sched.has_work():
            break
        batch = sched.schedule()
        steps.append(batch)
        assert batch.total_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        ones = [n == 1 for n in batch.num_tokens]
        assert ones == sorted(ones, reverse=True), "decode rows must come first"
        done += fake_step(sched, batch, sched.config.max_model_len)
    assert not sched.has_work(), "scheduler did not drain"
    return steps


def test_chunked_prefill_respects_budget() -> None:
    pool = BlockPool(64, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), pool)
    seq = make_seq(0, 200, 3)
    sched.add(seq)
    steps = run_to_end(sched, [seq])
    assert [b.num_tokens for b in steps[:4]] == [[64], [64], [64], [8]]
    assert seq.num_output_tokens == 3
    assert pool.num_free == 64


def test_decodes_share_steps_with_a_prefill() -> None:
    pool = BlockPool(64, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), pool)
    a, b = make_seq(0, 8, 10), make_seq(1, 100, 2)
    sched.add(a)
    fake_step(sched, sched.schedule(), 4096)  # a prefilled
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 31]


def test_fcfs_admission_order() -> None:
    pool = BlockPool(8, 16)  # room for 2 sequences of 64 tokens
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), pool)
    seqs = [make_seq(i, 40, 20) for i in range(6)]
    for s in seqs:
        sched.add(s)
    admitted: list[str] = []
    while sched.has_work():
        batch = sched.schedule()
        for s in batch.seqs:
            if s.request_id not in admitted:
                admitted.append(s.request_id)
        fake_step(sched, batch, 4096)
    assert admitted == [s.request_id for s in seqs]
    assert pool.num_free == 8


def test_preemption_recomputes_and_frees() -> None:
    pool = BlockPool(6, 4)  # 24 tokens of KV for three 16-token sequences
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64), pool)
    seqs = [make_seq(i, 6, 10) for i in range(3)]
    for s in seqs:
        sched.add(s)
    steps = run_to_end(sched, seqs)
    preempted = [p for b in steps for p in b.preempted]
    assert preempted, "the pool is too small for all three: someone must be preempted"
    assert all(p is not seqs[0] for p in preempted), "the oldest sequence is never the victim"
    assert all(s.num_output_tokens == 10 and s.status is Status.FINISHED for s in seqs)
    # Outputs are the same as without pressure: the fake token depends only on position.
    assert all(s.output_ids == [n % 97 for n in range(6, 16)] for s in seqs)
    assert pool.num_free == 6


def test_random_workload_drains_without_leaks() -> None:
    rng = random.Random(0)
    for trial in range(20):
        pool = BlockPool(rng.randint(8, 40), rng.choice([4, 8, 16]))
        cap = pool.num_blocks * pool.block_size
        sched = Scheduler(
            SchedulerConfig(
                max_num_seqs=rng.randint(1, 8),
                max_num_batched_tokens=rng.randint(8, 128),
                max_model_len=cap,
            ),
            pool,
        )
        seqs = []
        for i in range(rng.randint(1, 12)):
            prompt = rng.randint(1, cap // 2)
            seqs.append(make_seq(i, prompt, rng.randint(1, cap - prompt)))
            sched.add(seqs[-1])
        run_to_end(sched, seqs)
        assert pool.num_free == pool.num_blocks, f"trial {trial} leaked blocks"
        assert all(s.status is Status.FINISHED for s in seqs)


def test_kv_short_flags_a_request_waiting_for_blocks() -> None:
    """kv_short (BACKPRESSURE NO_KV_BLOCKS) holds exactly while the first waiting sequence
    cannot get its blocks, even when some blocks are free."""
    pool = BlockPool(num_blocks=5, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256), pool)
    first, second = make_seq(0, 40, 4), make_seq(1, 40, 4)  # 3 blocks each
    sched.add(first)
    sched.add(second)
    batch = sched.schedule()
    assert batch.seqs == [first] and sched.waiting[0] is second
    assert sched.kv_short and pool.num_free == 2  # free blocks, but not enough
    steps = run_to_end(sched, [first, second])
    assert not sched.kv_short and len(steps) > 1
