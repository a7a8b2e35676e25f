"""The in-process engine: requests in, streamed tokens out.

    engine = Engine(EngineConfig(model="tiny-llama"))
    engine.add_request("r1", "Hello", SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...

Each `step` schedules one batch within the token budget, runs one forward pass and returns
the new tokens of every sequence that produced one.
"""

from __future__ import annotations

import gc
import itertools
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import structlog
import torch

# The prefill kernels' CausalBias (kernels/reference.py imports it where it is used): its
# module imports torch._dynamo, ~2 s on 2 cores that the processes without an engine (the CPU
# daemon, the gateway) need not pay, and that an engine pays here, at start, not in a request.
import torch.nn.attention.bias

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.block_pool import BlockPool
from hybridgen.engine.host_layer_setup import setup_host_layers
from hybridgen.engine.host_memory import check_host_budget
from hybridgen.engine.memory import graph_batch_size, plan_engine_memory
from hybridgen.engine.model_runner import ModelRunner, Sampled, has_penalty
from hybridgen.engine.request_output import Completion, RequestOutput
from hybridgen.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from hybridgen.engine.sequence import FinishReason, Sequence
from hybridgen.engine.spill_policy import SpillCosts
from hybridgen.engine.startup import (
    StartupClock,
    measure_moe_gate,
    measure_regions,
    measure_spill_costs,
    place_attn_warm,
    place_moe_gate,
    setup_moe,
)
from hybridgen.engine.step_budget import StepBudget, key_weight
from hybridgen.engine.step_faults import (
    FaultDrill,
    device_usable,
    is_out_of_memory,
    step_failure,
)
from hybridgen.engine.validation import (
    InvalidRequest,
    UncheckedRequest,
    edge_checked,
    validate_extension,
    validate_request,
)
from hybridgen.experts.latency import LatencyModel
from hybridgen.experts.store import ExpertCache, MoeStats
from hybridgen.kvtiers.warm_drafts import WarmDrafts
from hybridgen.kvtiers.warm_offload import WarmOffload
from hybridgen.kvtiers.warm_tier import WarmTier
from hybridgen.models.host_layers import HostLayerStats
from hybridgen.models.loader import LoadedModel, load_model, model_spec
from hybridgen.models.mla import latent_kv_unsupported
from hybridgen.parallel import launch as tensor_parallel
from hybridgen.parallel.model import RankLost, ShardedCausalLM
from hybridgen.placement.degrade import Degrade
from hybridgen.placement.tuner import Tuner
from hybridgen.placement.tuning_profile import RegionProfile
from hybridgen.runtime import sd_notify
from hybridgen.sampling.candidates import Candidates, sample_candidates
from hybridgen.sampling.params import SamplingParams

log = structlog.get_logger()


TIER_LOG_STEPS = 256
"""With a Warm tier in use, the KV tier figures are logged every this many steps."""


STEP_PHASES = ("schedule", "decode", "prefill", "warm", "outputs")
"""The engine's time by phase (EngineStats.seconds; GetModelInfo step_s_<phase>): schedule,
choosing each step's batch (admissions, Warm loads of prefix hits, spills, swaps, preemption);
decode, prefill and warm, forward passes until their tokens are on the host, of decodes alone
from Hot, of batches that carry prompt tokens, and of batches that read Warm keys; outputs,
turning tokens into outputs, stops and finishes (a finished sequence's write-back to Warm
included)."""


FORWARD_PHASES = ("decode", "prefill", "warm")
"""The STEP_PHASES that are forward passes, counted in PassCounts (GetModelInfo
step_n_<phase>, step_rows_<phase>, step_tokens_<phase>)."""


@dataclass
class PassCounts:
    """One kind of forward pass (FORWARD_PHASES) since start: how many ran, the decode rows
    (one new token each) and the prompt tokens they computed. With the phase's seconds they
    give its mean pass time and batch: what a run's time per token is made of."""

    passes: int = 0
    rows: int = 0
    prompt_tokens: int = 0

    def add(self, num_tokens: Iterable[int]) -> None:
        """One pass computing `num_tokens` for its rows (1: a decode row; more: a chunk)."""
        self.passes += 1
        for n in num_tokens:
            if n == 1:
                self.rows += 1
            else:
                self.prompt_tokens += n


@dataclass
class EngineStats:
    """Counters since start."""

    steps: int = 0
    preemptions: int = 0
    failed_steps: int = 0
    """Steps that raised: their requests ended with an error, the engine went on."""
    max_step_tokens: int = 0
    """Most tokens computed in one step (never above max_num_batched_tokens)."""
    peak_blocks_used: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    """Where the engine's time went, by STEP_PHASES: the step loop's account of itself."""
    passes: dict[str, PassCounts] = field(
        default_factory=lambda: {p: PassCounts() for p in FORWARD_PHASES}
    )
    """Forward passes by FORWARD_PHASES (a multi-step decode's every step counts)."""


def load_configured(config: EngineConfig) -> LoadedModel:
    """The model `config` names, on its device in its dtype; with Cold-Weights on, its
    experts in host memory in cold_weights.expert_format (in the shared arena of
    shm_instance, when set); with weights.gpu_layers, the layers past it straight into host
    memory; with tensor_parallel > 1, rank 0's shard, its workers started. What Engine loads
    when it is given no model."""
    if config.tensor_parallel > 1:
        return tensor_parallel.start(config)
    host_experts = config.expert_format if config.expert_cache_slots is not None else None
    return load_model(
        config.model,
        config.torch_device(),
        config.torch_dtype(),
        config.seed,
        host_experts,
        config.shm_instance,
        config.weights_format,
        config.gpu_layers,
    )


def _forward_phase(batch: ScheduledBatch) -> str:
    """The STEP_PHASES entry a batch's forward pass counts under."""
    if any(s.warm_slots for s in batch.seqs):
        return "warm"
    return "prefill" if any(n > 1 for n in batch.num_tokens) else "decode"


def _timed(
    steps: Iterator[list[Sampled]], stats: EngineStats, phase: str
) -> Iterator[list[Sampled]]:
    """`steps` (decode passes of one row per sampled token), the time each one takes to come
    added to stats.seconds[phase] and each counted in stats.passes[phase]."""
    while True:
        start = time.perf_counter()
        step = next(steps, None)
        stats.seconds[phase] += time.perf_counter() - start
        if step is None:
            return
        stats.passes[phase].add([1] * len(step))
        yield step


def _pick(seq: Sequence, cands: Candidates) -> Sampled:
    token, logprob = sample_candidates(cands, seq.params, seq.seed, seq.num_output_tokens)
    return Sampled(seq, token, logprob if seq.params.logprobs is not None else None, None)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = config.torch_device()
        self.measured: dict[str, RegionProfile] = {}
        """Regions timed at start (region_timing) and the placement each got."""
        self._owns_loaded = loaded is None
        self._foreign = _reserved_elsewhere(self.device)
        """Device memory this process held before the engine (tests, benchmarks): the cap
        lets the engine have its budget beside it."""
        spec = loaded.spec if loaded is not None else model_spec(config.model)
        check_host_budget(config, spec, experts_made=loaded is not None)
        why = latent_kv_unsupported(spec, config.hot_codec, config.warm_pool_mb)
        if why is not None:
            raise ConfigError(why)
        self._clock = StartupClock()
        self.loaded = loaded or load_configured(config)
        self._clock.mark("load")
        self.warm: WarmTier | None = None
        try:
            self._start()
        except BaseException:  # the engine never existed: its host memory goes with it
            self._free_host_memory()
            raise

    def _start(self) -> None:
        """Everything after loading: the expert cache, the memory plan, the Warm tier, the
        runner, the scheduler and the start-up measurements."""
        sd_notify.status("warming up")  # under a supervisor; a no-op in-process
        config = self.config
        spec = self.spec = self.loaded.spec  # tensor parallel: the model's is one rank's
        clock = self._clock
        self.host_layers = setup_host_layers(config, self.loaded.model, self.device)
        """Layers whose projections live in host memory (weights.gpu_layers), if any."""
        clock.mark("host_layers")
        self.experts: tuple[ExpertCache, LatencyModel] | None = setup_moe(
            config,
            self.loaded.model,
            self.device,
            lambda: _reserved_elsewhere(self.device) - self._foreign,
        )
        """Cold-Weights: the shared device cache of experts and the latency model."""
        clock.mark("moe")
        held = _reserved_elsewhere(self.device) - self._foreign  # what loading left held
        self.plan, self.max_model_len = plan_engine_memory(
            config, self.loaded.model, self.device, held
        )
        clock.mark("memory_plan")
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            cap = (self.plan.budget + self._foreign) / total
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap), self.device)
        if config.warm_pool_mb > 0:
            self.warm = WarmTier.from_config(config, spec, self.device)
        clock.mark("warm_tier")
        self.runner = self._runner()
        clock.mark("kv_pool_and_graphs")
        self.pool = BlockPool(self.plan.num_blocks, config.block_size)
        self.step_times = StepBudget(config.step_latency_ms / 1e3, key_weight(spec))
        """Measured step times: decode-first steps' budget (with step_latency_ms), and the
        decode and prefill costs the spill decision weighs."""
        self.offload: WarmOffload | None = None
        self.spill_costs: SpillCosts | None = None
        if self.warm is not None:
            self.spill_costs = SpillCosts(self.step_times)
            if config.spill_policy == "auto":
                measure_spill_costs(self.spill_costs, self.warm, self.runner.kv_caches, config)
                clock.mark("spill_costs")
            self.warm.step_times = self.step_times
            self.offload = WarmOffload(
                self.warm, self.pool, self.runner.kv_caches, config.prefix_reuse, self.spill_costs
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                config.prefix_reuse,
                config.hot_turn_tokens,
                config.spill_policy,
            ),
            self.pool,
            self.offload,
            self.step_times if config.step_latency_ms > 0 else None,
            self.spill_costs,
        )
        self._synced = True  # the last step ended with the host waiting for the device
        drafts = config.warm_draft_tokens if self.warm is not None else 0
        self.drafts = WarmDrafts(drafts, self.runner, self.scheduler, self.max_model_len)
        self.eos_ids = frozenset(self.loaded.generation.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.faults = FaultDrill.from_env()
        """The fault drill (HYBRIDGEN_FAULT_STEPS): none unless asked for."""
        if self.warm is not None and config.dynamic_tuning:
            self.warm.tuner = Tuner(
                self.warm, config.tuning_warmup_steps, config.tuning_interval_ms
            )
        self.degrade = Degrade(config, self.warm, spec.vocab_size, "attn_warm" in self.measured)
        """Backpressure degrade: placements shifted toward the CPU while it holds."""
        self._place(measure_regions(config, self.device, spec.vocab_size, self.warm))
        clock.mark("regions")
        if self.experts is not None:  # counted from the first served step: the start-up's
            self.experts[0].stats = MoeStats()  # profiling prefill repeats one token
        if self.host_layers is not None:  # likewise: served steps only
            self.host_layers.stats = HostLayerStats()
        self._next_age = 0.0  # when to look for Warm blocks to move to Cold
        self._arrivals = 0
        clock.mark("other")
        self.startup_s = clock.seconds
        """Seconds each start-up stage took (StartupClock), the weights' load first."""
        log.info(
            "engine_ready",
            startup_s={stage: round(s, 2) for stage, s in self.startup_s.items()},
            model=spec.name,
            synthetic=spec.synthetic,
            device=str(self.device),
            dtype=str(spec.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            **self.plan.summary(),
        )

    def _place(self, measured: dict[str, RegionProfile]) -> None:
        """Put each region timed at start (startup.measure_*) on its faster side."""
        for region, r in measured.items():
            if region == "moe_gate":
                place_moe_gate(self.loaded.model, r.placement)
            elif region == "sample":
                self.degrade.place_sample(r.placement)
            elif region == "kv_codec" and self.warm is not None:
                self.warm.codec_on = r.placement
        self.measured.update(measured)

    def _runner(self) -> ModelRunner:
        """attn_warm placed (its timing must come before the KV pool), then the model runner
        with the KV pool and the CUDA graphs."""
        config = self.config
        if self.warm is not None:
            self.measured.update(place_attn_warm(self.warm, config, self.device))
            self._clock.mark("attn_warm")
        graph_batch = graph_batch_size(config, self.loaded.model)
        graphed = bool(graph_batch) and self.device.type == "cuda"
        self._place(measure_moe_gate(config, self.loaded.model, self.device, graphed))
        self._clock.mark("moe_gate")
        self._check_reach()
        return ModelRunner(
            self.loaded.model,
            self.spec,
            self.plan.num_blocks,
            config.block_size,
            self.max_model_len,
            self.device,
            graph_batch,
            config.hot_codec,
            self.warm,
        )

    def tier_stats(self) -> dict[str, float | int | str]:
        """KV tier figures since start, keyed by GetModelInfo field names: prefix reuse (by
        tier), the Warm tier's (hot hit rate, decompress latency, PCIe bytes, CPU attention,
        blocks kept for reuse) and the spill decisions with their inputs."""
        sched = self.scheduler
        stats: dict[str, float | int | str] = {"prefix_cached_tokens": sched.prefix_hit_tokens}
        stats.update(sched.prefix_hits.info())
        if self.warm is not None:
            stats.update(self.warm.info())
            stats.update(self.drafts.stats.info())
        if self.offload is not None:
            stats["warm_kept_blocks"] = self.offload.kept_blocks
            stats["warm_keep_skipped"] = self.offload.keep_gate.shut
            stats["warm_keep_failed"] = self.offload.keep_failed
            stats["warm_keep_recomputed"] = self.offload.keep_gate.recomputed
        if sched.policy is not None:
            stats.update(sched.policy.info())
        return stats

    def moe_stats(self) -> dict[str, float]:
        """Cold-Weights counters since start (all zero without it): cache hits and misses,
        hit rate, experts computed on the CPU and on the device (also per step), bytes
        copied host -> device."""
        stats = self.experts[0].stats if self.experts is not None else MoeStats()
        return stats.figures(self.stats.steps)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The edge's checks with this engine's limits, for an in-process front end (the
        offline CLI, the profiler): InvalidRequest or InvalidSamplingParameter naming the
        field and the allowed range."""
        validate_request(prompt_ids, params, self.spec.vocab_size, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        prompt_open: bool = False,
    ) -> None:
        """A request the edge validated (engine/validation.py); `prompt_open`: streaming
        input, the prompt's first part, extend_prompt brings more. UncheckedRequest when it
        breaks what the edge's checks guarantee, and nothing is admitted."""
        if request_id in self.seqs:
            raise UncheckedRequest(f"request_id {request_id!r} is already running")
        ids = self.loaded.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        with edge_checked():
            validate_request(ids, params, self.spec.vocab_size, self.max_model_len, prompt_open)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, len(ids), ids, params, seed, self._arrivals, self.eos_ids)
        seq.prompt_open = prompt_open
        self._arrivals += 1
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def extend_prompt(self, request_id: str, keep: int, token_ids: list[int], last: bool) -> None:
        """Streaming input: an open prompt becomes its first `keep` tokens then `token_ids`;
        `last` closes it and decoding starts. InvalidRequest when the request has no open
        prompt (aborted meanwhile), UncheckedRequest when the edge's checks of the chunk
        (stream_input.PromptFeed) were skipped; the request stays either way."""
        seq = self.seqs.get(request_id)
        if seq is None or not seq.prompt_open:
            raise InvalidRequest("request_id", f"{request_id!r} has no open prompt")
        limits = (self.spec.vocab_size, self.max_model_len)
        with edge_checked():
            validate_extension(seq.prompt_len, keep, token_ids, seq.params, *limits, last)
        self.scheduler.extend_prompt(seq, keep, token_ids, last)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks at once; False if it is unknown."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.CANCELLED
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self, defer_sampling: bool = False) -> list[RequestOutput]:
        """One scheduled batch (`steps`), its outputs joined per request."""
        joined: dict[str, RequestOutput] = {}
        for outputs in self.steps(defer_sampling):
            for out in outputs:
                before = joined.get(out.request_id)
                joined[out.request_id] = out if before is None else before.then(out)
        return list(joined.values())

    def steps(self, defer_sampling: bool = False) -> Iterator[list[RequestOutput]]:
        """One scheduled batch: one forward pass, or several decode steps in a row, each
        step's outputs yielded as soon as its tokens are on the host. With sample_placement
        cpu the rows' top-k logits come back to the host, and the token is picked there:
        here at once, or, with `defer_sampling`, by the caller (the CPU daemon), who answers
        with accept_token.

        A step that raises ends the requests in it (their outputs carry the error) and frees
        their KV; the engine goes on with the others. A device left unusable (a sticky CUDA
        error) or a lost tensor-parallel rank is not survivable: that exception propagates."""
        batch: ScheduledBatch | None = None
        try:
            start = time.perf_counter()
            batch = self.scheduler.schedule()
            self.stats.seconds["schedule"] += time.perf_counter() - start
            self.stats.preemptions += len(batch.preempted)
            if batch.seqs:
                self.faults.check(self.stats.steps, self.device)
                yield from self._run(batch, defer_sampling)
        except Exception as exc:
            if isinstance(exc, RankLost) or not device_usable(self.device):
                raise
            failed = batch.seqs if batch is not None else list(self.scheduler.running)
            yield self._fail(failed, exc)

    def _run(self, batch: ScheduledBatch, defer_sampling: bool) -> Iterator[list[RequestOutput]]:
        start = time.perf_counter()  # before any path runs the forward pass (some do at once)
        on_host = self._samples_on_host(batch)
        drafts = 0 if on_host else self.drafts.length(batch)
        steps = 1 if on_host or drafts else self._decode_steps(batch)
        picked: list[tuple[Sequence, Candidates]] = []
        per_step: Iterator[list[Sampled]] = iter(())
        if on_host:
            picked = self.runner.execute_candidates(batch, self.config.num_candidates)
        elif drafts:
            per_step = iter(self.drafts.run(batch, drafts))
        elif steps > 1:
            per_step = self.runner.decode_steps(batch, steps)
        else:
            per_step = iter([self.runner.execute(batch)])
        first = None if on_host else next(per_step)  # the batch's forward pass is done
        launch = self.runner.queued_at - start if self._runs_ahead(batch, steps, drafts) else None
        forward = time.perf_counter() - start
        self._observe(batch, forward, on_host or bool(first), launch)
        phase = _forward_phase(batch)
        self.stats.seconds[phase] += forward
        self.stats.passes[phase].add(batch.num_tokens)
        per_step = _timed(per_step, self.stats, phase)  # decode_steps' later steps
        self._account(batch)
        if on_host and defer_sampling:
            yield [self._await_token(seq, c) for seq, c in picked]
            return
        if on_host:
            first = [_pick(seq, c) for seq, c in picked]
        assert first is not None
        for j, sampled in enumerate(itertools.chain([first], per_step)):
            start = time.perf_counter()
            outputs: dict[str, RequestOutput] = {}
            for s in sampled:
                seq = s.seq
                if seq.finish_reason is not None:
                    continue  # a token computed past this sequence's stop
                if j:
                    seq.num_computed_tokens += 1  # the previous step's token went through
                self._record(seq, s, outputs)
            self.stats.seconds["outputs"] += time.perf_counter() - start
            yield list(outputs.values())

    def _runs_ahead(self, batch: ScheduledBatch, steps: int, drafts: int) -> bool:
        """Whether this batch is one forward pass that the host queues without waiting for
        the device, so that its launch time is the host's alone (the step budget's floor):
        not on a device that computes as called (a CPU, a MoE model), not with host layers
        that wait for the CPU's rows, not under tensor parallel (rank 0 announces the logits to
        its workers with a header whose copy to the device waits for the forward pass)."""
        if steps != 1 or drafts or self.runner.computes_as_called:
            return False
        if self.host_layers is not None and self.host_layers.waits_on_host(batch.total_tokens):
            return False
        return self.config.tensor_parallel == 1

    def _observe(
        self, batch: ScheduledBatch, seconds: float, synced: bool, launch: float | None
    ) -> None:
        """Feed the measured step times a step's time (and its launch's, for an eager forward
        on a device that runs behind the host): only when it and the step before it ended
        with the host waiting for the device (else the time is the launch, or includes the
        last step's work). Steps from Hot alone go to the step budget; decode steps that read
        Warm go to the spill costs, as what reading Warm adds."""
        if synced and self._synced:
            chunks = [
                (n, s.num_computed_tokens)
                for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
                if n > 1
            ]
            warm = sum(len(s.warm_slots) for s in batch.seqs)
            if not warm:
                self.step_times.observe(batch.num_decode, chunks, seconds, launch)
            elif not chunks and self.spill_costs is not None:
                self.spill_costs.observe_warm_step(batch.num_decode, warm, seconds)
        self._synced = synced

    def _account(self, batch: ScheduledBatch) -> None:
        """After a batch's forward pass: counters, the Warm tier's housekeeping, and each
        sequence's computed tokens (registered for prefix reuse)."""
        st = self.stats
        st.steps += 1
        self.degrade.stats.steps += self.degrade.active
        if self.warm is not None and self.warm.tuner is not None:
            self.warm.tuner.on_step(st.steps)
        if self.warm is not None and time.monotonic() >= self._next_age:
            self.warm.age()
            self._next_age = time.monotonic() + self.warm.cold.threshold_s / 2
        if self.warm is not None and st.steps % TIER_LOG_STEPS == 0 and self.warm.stats.warm_keys:
            log.info("kv_tiers", steps=st.steps, **self.tier_stats())
        st.max_step_tokens = max(st.max_step_tokens, batch.total_tokens)
        st.peak_blocks_used = max(st.peak_blocks_used, self.pool.num_used)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
            self.scheduler.cache_blocks(seq)

    def _fail(self, seqs: list[Sequence], exc: Exception) -> list[RequestOutput]:
        """End the requests of a step that raised `exc`: each gets an output carrying the
        error, and its KV blocks are freed."""
        error = step_failure(exc)
        self.stats.failed_steps += 1
        log.error(
            "step_failed",
            code=error.code.name,
            requests=[s.request_id for s in seqs],
            exc_info=exc,
        )
        if is_out_of_memory(exc) and self.device.type == "cuda":
            torch.cuda.empty_cache()
        outputs = []
        for seq in seqs:
            if self.seqs.pop(seq.request_id, None) is None:
                continue  # it had finished in an earlier step of the batch
            seq.finish_reason = FinishReason.CANCELLED
            self.scheduler.finish(seq, keep=False)
            outputs.append(
                RequestOutput(
                    seq.request_id,
                    [],
                    True,
                    FinishReason.CANCELLED,
                    None,
                    None,
                    seq.prompt_len,
                    seq.num_output_tokens,
                    error=error,
                )
            )
        return outputs

    def _samples_on_host(self, batch: ScheduledBatch) -> bool:
        return self.degrade.sample_placement == "cpu" and not any(
            has_penalty(s.params) for s in batch.seqs
        )

    def _await_token(self, seq: Sequence, cands: Candidates) -> RequestOutput:
        seq.awaiting_token = True
        return RequestOutput(
            seq.request_id,
            [],
            False,
            None,
            None,
            None,
            seq.prompt_len,
            seq.num_output_tokens,
            cands,
        )

    def accept_token(self, request_id: str, token_id: int, logprob: float) -> RequestOutput:
        """The token the CPU picked for a sequence that was awaiting one."""
        seq = self.seqs.get(request_id)
        if seq is None or not seq.awaiting_token:
            raise InvalidRequest("request_id", f"{request_id!r} is not waiting for a token")
        if not 0 <= token_id < self.spec.vocab_size:
            raise InvalidRequest("token_id", f"{token_id} is outside [0, {self.spec.vocab_size})")
        seq.awaiting_token = False
        lp = logprob if seq.params.logprobs is not None else None
        outputs: dict[str, RequestOutput] = {}
        self._record(seq, Sampled(seq, token_id, lp, None), outputs)
        return outputs[request_id]

    def _decode_steps(self, batch: ScheduledBatch) -> int:
        """How many decode steps this batch can run before the host must look again: one
        where a step waits on the host anyway (host layers with a CPU share), since queuing
        the next step would only hold this step's tokens back until it has run."""
        k = self.config.decode_steps
        if k == 1 or batch.num_decode != len(batch) or any(s.warm_slots for s in batch.seqs):
            return 1
        if self.host_layers is not None and self.host_layers.waits_on_host(len(batch)):
            return 1
        for seq in batch.seqs:
            room = seq.decode_room(self.max_model_len)
            if not room or has_penalty(seq.params):
                return 1
            k = min(k, room)
        if k > 1 and not self.scheduler.reserve_lookahead(batch, k):
            return 1
        return max(k, 1)

    def _record(self, seq: Sequence, s: Sampled, outputs: dict[str, RequestOutput]) -> None:
        """Append one sampled token, finish the sequence if it stops, and add to its output."""
        seq.append(s.token_id, self.max_model_len)
        if s.logprob is not None:
            seq.logprobs.append(s.logprob)
        if s.top is not None:
            seq.top_logprobs.append(s.top)
        finished = seq.finish_reason is not None
        if finished:
            self.scheduler.finish(seq)
            del self.seqs[seq.request_id]
        out = outputs.get(seq.request_id)
        if out is None:
            out = outputs[seq.request_id] = RequestOutput(
                seq.request_id, [], False, None, None, None, seq.prompt_len, 0
            )
        out.new_token_ids.append(s.token_id)
        if s.logprob is not None:
            out.logprobs = [*(out.logprobs or []), s.logprob]
        if s.top is not None:
            out.top_logprobs = [*(out.top_logprobs or []), s.top]
        out.finished, out.finish_reason = finished, seq.finish_reason
        out.output_tokens = seq.num_output_tokens

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Run prompts to completion together (continuous batching) and return them in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        logprobs: dict[str, list[float]] = {rid: [] for rid in ids}
        done: dict[str, Completion] = {}
        while len(done) < len(ids):
            for out in self.step():
                rid = out.request_id
                if rid not in tokens:
                    continue
                tokens[rid] += out.new_token_ids
                logprobs[rid] += out.logprobs or []
                if out.finished:
                    assert out.finish_reason is not None
                    done[rid] = Completion(
                        rid, tokens[rid], out.finish_reason, logprobs[rid] or None
                    )
        return [done[r] for r in ids]

    def _check_reach(self) -> None:
        if self.warm is None:
            return
        reach = (self.plan.num_blocks + self.warm.pool.capacity) * self.config.block_size
        if reach < self.max_model_len:
            raise ConfigError(
                f"warm_pool_mb={self.config.warm_pool_mb} is too small: Hot and Warm together "
                f"hold {reach} tokens, max_model_len is {self.max_model_len}"
            )

    def release(self) -> None:
        """Free the weights, the KV pool and the graphs, and lift the memory cap; the engine
        cannot be used afterwards."""
        del self.runner, self.drafts  # the drafts hold the runner too
        self._free_host_memory()
        del self.loaded
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def close(self) -> None:
        """Stop what would outlive a process that exits without its interpreter's teardown
        (the GPU daemon's fast stop): tensor-parallel workers leave the process group."""
        if self._owns_loaded and isinstance(self.loaded.model, ShardedCausalLM):
            tensor_parallel.stop(self.loaded.model)

    def _free_host_memory(self) -> None:
        """Unpin and unlink the Warm pool and, when this engine loaded the model, the shared
        expert arena and the host layers' CPU worker."""
        if self.warm is not None:
            self.warm.close()
        if self._owns_loaded and self.loaded.expert_arena is not None:
            self.loaded.expert_arena.close()
        if self._owns_loaded and self.loaded.model.host_layers is not None:
            self.loaded.model.host_layers.close()  # its CPU worker thread
        if self._owns_loaded and isinstance(self.loaded.model, ShardedCausalLM):
            tensor_parallel.stop(self.loaded.model)

    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """fp32 logits [V] after the whole prompt, in one pass outside the scheduler (for
        checks against a reference; needs free blocks for the prompt)."""
        seq = Sequence("prompt_logits", len(prompt_ids), list(prompt_ids), SamplingParams(), 0, -1)
        seq.block_ids = self.pool.allocate(self.pool.blocks_for(len(prompt_ids)))
        try:
            logits, _ = self.runner.logits(ScheduledBatch([seq], [len(prompt_ids)]))
        finally:
            self.pool.free(seq.block_ids)
        assert logits is not None
        return logits[0]


def _reserved_elsewhere(device: torch.device) -> int:
    """Device memory the process holds now (its allocator's cached blocks given back first);
    0 off CUDA."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
