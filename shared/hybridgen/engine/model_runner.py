"""Turns a scheduled batch into one forward pass and one sampling call.

Per step the host builds the packed inputs with numpy, copies them to the device in two
transfers, and reads back only the sampled ids (plus logprobs when asked): that `.tolist()`
is the step's one synchronisation.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Literal, NamedTuple

import numpy as np
import torch

from hybridgen.engine.cuda_graphs import DecodeGraphs
from hybridgen.engine.moe_graphs import MoeDecodeGraphs
from hybridgen.engine.scheduler import ScheduledBatch
from hybridgen.engine.sequence import Sequence
from hybridgen.kernels import ops
from hybridgen.kernels.kv_quant import QuantKvCache
from hybridgen.kvtiers.warm_tier import WarmTier
from hybridgen.models.llama import AttentionBatch, CausalLM
from hybridgen.models.rope import rope_tables
from hybridgen.models.spec import ModelSpec
from hybridgen.runtime.upload import upload
from hybridgen.sampling.candidates import MIN_TEMPERATURE, Candidates
from hybridgen.sampling.params import SamplingParams
from hybridgen.sampling.sampler import Sampler, SamplerOutput, SamplingBatch


@dataclass
class Sampled:
    """One sampled token for a sequence that completed its prompt or decoded."""

    seq: Sequence
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None


class _Row(NamedTuple):
    """Tokens one sequence computes in a step (a prefill chunk, or one decode token)."""

    seq: Sequence
    start: int
    """Position of ids[0]."""
    ids: list[int]
    samples: bool
    """A token is sampled after the last of them."""


@dataclass
class StepInputs:
    """Packed device inputs of one step, and which hidden rows to sample from."""

    input_ids: torch.Tensor
    batch: AttentionBatch
    sample_rows: list[int]
    """Index into the packed tokens of the last token of each sequence that samples."""
    sample_index: torch.Tensor
    """sample_rows on the device, copied with the other inputs: indexing with the list would
    copy it mid-step, and wait there for the forward pass so far."""
    sample_seqs: list[Sequence]


def computes_as_called(device: torch.device, spec: ModelSpec) -> bool:
    """Whether a decode step has run by the time its launching call returns, so that queuing
    the next step first would only hold this one's tokens back: on a CPU; and for a MoE
    model on any device, since every MoE layer reads its experts' ids back to the host to
    place them (models/moe.py, engine/moe_graphs.py), which waits for the step so far."""
    return device.type != "cuda" or bool(spec.num_local_experts)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        graph_batch: int,
        hot_codec: str = "native",
        warm: WarmTier | None = None,
    ) -> None:
        self.model, self.spec, self.device = model, spec, device
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        # The model's own heads: under tensor parallel one rank's share of spec's.
        self.kv_caches = _allocate_kv(model.spec, num_blocks, block_size, device, hot_codec)
        self.warm = warm
        cos, sin = rope_tables(
            spec.rope, spec.rope_dim, spec.max_position_embeddings, max_model_len
        )
        self.rope = (cos.to(device), sin.to(device))
        self.sampler = Sampler()
        self.computes_as_called = computes_as_called(device, spec)
        self.queued_at = 0.0
        """When the last execute had queued its work (perf_counter)."""
        self.graphs: DecodeGraphs | MoeDecodeGraphs | None = None
        if graph_batch and device.type == "cuda" and spec.num_local_experts:
            self.graphs = MoeDecodeGraphs(
                model, self.kv_caches, self.rope, graph_batch, self.max_blocks, device
            )
        elif graph_batch and device.type == "cuda":
            self.graphs = DecodeGraphs(self._decode_logits, graph_batch, self.max_blocks, device)

    def kv_bytes(self) -> int:
        """Device bytes of every layer's Hot-KV (codes, scales and zeros included)."""
        total = 0
        for kv in self.kv_caches:
            # Native: K and V, or their one tensor (MLA, spec.kv_copies); else the codes etc.
            parts = (
                kv[: self.spec.kv_copies]
                if isinstance(kv, tuple)
                else [getattr(kv, f.name) for f in fields(kv)]
            )
            total += sum(t.numel() * t.element_size() for t in parts if t is not None)
        return total

    def _decode_logits(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        hidden = self.model(input_ids, batch, self.kv_caches, self.rope)
        return self.model.compute_logits(hidden)

    def prepare(self, sched: ScheduledBatch, hot_only: bool = False) -> StepInputs:
        """The step's packed inputs: each sequence's next `num_tokens` tokens, sampling after
        the last when that completes it. `hot_only`: attend Hot keys alone (Warm drafts)."""
        rows = []
        for seq, n in zip(sched.seqs, sched.num_tokens, strict=True):
            c = seq.num_computed_tokens
            rows.append(_Row(seq, c, seq.token_ids[c : c + n], c + n == seq.num_tokens))
        return self._pack(rows, sched.num_decode, 0 if hot_only else 1)

    def _pack(self, rows: list[_Row], num_decode: int, warm_rows: int) -> StepInputs:
        """Rows (the first `num_decode` of one token each) as packed device inputs. With a
        Warm tier and `warm_rows` > 0, every run of `warm_rows` rows is one sequence's, and
        attends its Warm keys once for all of them; 0: no row reads Warm."""
        bs = self.block_size
        ids, pos, slots, sample_rows, sample_seqs = [], [], [], [], []
        qsl, seq_lens = [0], []
        width = max(len(r.seq.block_ids) for r in rows)
        tables = np.zeros((len(rows), width), dtype=np.int32)
        hot_lens = []  # keys in the Hot cache: block tables start after the Warm prefix
        for i, row in enumerate(rows):
            c, n, warm = row.start, len(row.ids), len(row.seq.warm_slots) * bs
            p = np.arange(c, c + n)
            blocks = np.asarray(row.seq.block_ids, dtype=np.int64)
            tables[i, : len(blocks)] = blocks
            ids.append(np.asarray(row.ids, dtype=np.int64))
            pos.append(p)
            slots.append(blocks[(p - warm) // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            hot_lens.append(c + n - warm)
            if row.samples:
                sample_rows.append(qsl[-1] - 1)
                sample_seqs.append(row.seq)
        rows_sampled = np.asarray(sample_rows, dtype=np.int64)
        longs = torch.from_numpy(np.concatenate([*ids, *pos, *slots, rows_sampled])).to(self.device)
        ints = torch.from_numpy(
            np.concatenate([np.asarray(hot_lens, np.int32), tables.ravel()])
        ).to(self.device)
        warm_keys = None
        if self.warm is not None and warm_rows:
            r = warm_rows
            warm_keys = self.warm.context(
                [row.seq.warm_slots for row in rows[::r]], [n - 1 for n in seq_lens[r - 1 :: r]], r
            )
            st = self.warm.stats
            st.hot_keys += sum(hot_lens[:num_decode])
            st.warm_keys += sum(seq_lens[:num_decode]) - sum(hot_lens[:num_decode])
        t, b = qsl[-1], len(seq_lens)
        batch = AttentionBatch(
            positions=longs[t : 2 * t],
            slot_mapping=longs[2 * t : 3 * t],
            block_tables=ints[b:].view(b, width),
            seq_lens=ints[:b],
            num_decode=num_decode,
            query_start_loc=qsl,
            seq_lens_host=seq_lens,
            warm=warm_keys,
        )
        return StepInputs(longs[:t], batch, sample_rows, longs[3 * t :], sample_seqs)

    @torch.inference_mode()
    def logits(self, sched: ScheduledBatch) -> tuple[torch.Tensor | None, list[Sequence]]:
        """One forward pass; logits [N, V] fp32 of the N sequences that sample this step."""
        inputs = self.prepare(sched)
        graphs = self.graphs
        if (
            graphs is not None
            and inputs.batch.warm is None
            and sched.num_decode == len(sched) <= graphs.max_batch
        ):
            logits = graphs.run(inputs.input_ids, inputs.batch)
            if len(inputs.sample_rows) < len(sched):  # a one-token prompt chunk samples nothing
                logits = logits[inputs.sample_index]
            return logits, inputs.sample_seqs
        hidden = self.model(inputs.input_ids, inputs.batch, self.kv_caches, self.rope)
        if not inputs.sample_seqs:
            return None, []
        return self.model.compute_logits(hidden[inputs.sample_index]), inputs.sample_seqs

    @torch.inference_mode()
    def execute(self, sched: ScheduledBatch) -> list[Sampled]:
        """One forward pass and its sampled tokens; `queued_at` is when the host had queued
        all of it (perf_counter), before it waited for the tokens."""
        logits, seqs = self.logits(sched)
        if logits is None:
            self.queued_at = time.perf_counter()
            return []
        return self._sample(logits, seqs)

    def execute_decode(
        self, sched: ScheduledBatch, steps: int, hot_only: bool = False
    ) -> list[list[Sampled]]:
        """decode_steps, all at once."""
        return list(self.decode_steps(sched, steps, hot_only))

    def decode_steps(
        self, sched: ScheduledBatch, steps: int, hot_only: bool = False
    ) -> Iterator[list[Sampled]]:
        """`steps` decode steps back to back, each step's tokens yielded as soon as they are
        on the host.

        Each step's sampled ids feed the next step on the device, and positions, seq_lens and
        cache slots advance there too, so the host only launches work: step j + 1 is queued
        before the host waits for step j's tokens (copied to pinned memory behind an event),
        so the device keeps busy while the caller streams them. Where a step is computed as it
        is called (computes_as_called: the CPU, or a MoE model's expert picks read back each
        layer), each step's tokens go at once (else the caller's first step would wait for
        two, and a step's measured time would be two). Precondition: every
        sequence decodes, samples without penalties, and already holds the blocks for
        `steps` more tokens, and none has Warm keys unless `hot_only` (drafts that attend
        Hot alone). Yields each step's tokens, one per sequence, in order.
        """
        # inference_mode never spans a yield: the caller's code between steps runs outside it.
        with torch.inference_mode():
            inputs = self.prepare(sched, hot_only)
        seqs = inputs.sample_seqs
        ids, batch = inputs.input_ids, inputs.batch
        base = [s.num_output_tokens for s in seqs]  # the caller records tokens meanwhile
        pending: list[_Pending] = []
        for j in range(steps):
            with torch.inference_mode():
                logits = self._decode_logits_any(ids, batch)
                out = self.sampler(logits, self._sampling_batch(seqs, [b + j for b in base]))
                pending.append(_Pending.start(out))
                if j + 1 < steps:
                    ids, batch = out.token_ids, self._advance(batch)
            if self.computes_as_called:  # nothing runs behind the host: hand it over at once
                yield self._to_host(pending[j].wait(), seqs)
            elif j:  # step j is queued: hand over step j - 1 meanwhile
                yield self._to_host(pending[j - 1].wait(), seqs)
        if not self.computes_as_called:
            yield self._to_host(pending[-1].wait(), seqs)

    @torch.inference_mode()
    def execute_check(self, sched: ScheduledBatch, drafts: list[list[int]]) -> list[list[Sampled]]:
        """Check drafted tokens: each decoding sequence's pending token and its k drafts
        (the same k for all) as k + 1 decode rows, attending Hot and, once for all its rows,
        Warm. Row j samples with the step offset j, as the j-th plain decode step would, so
        its token is the one plain decoding picks wherever the drafts before it are right.
        Precondition: as execute_decode's for k + 1 steps. Returns each sequence's k + 1
        tokens."""
        r = len(drafts[0]) + 1
        rows = []
        for seq, draft in zip(sched.seqs, drafts, strict=True):
            c = seq.num_computed_tokens
            ids = [seq.token_ids[c], *draft]
            rows += [_Row(seq, c + j, [tok], True) for j, tok in enumerate(ids)]
        inputs = self._pack(rows, len(rows), r)
        logits = self._decode_logits(inputs.input_ids, inputs.batch)
        seqs = [seq for seq in sched.seqs for _ in range(r)]
        steps = [s.num_output_tokens + j for s in sched.seqs for j in range(r)]
        sampled = self._to_host(self.sampler(logits, self._sampling_batch(seqs, steps)), seqs)
        return [sampled[i * r : (i + 1) * r] for i in range(len(sched.seqs))]

    @torch.inference_mode()
    def execute_candidates(
        self, sched: ScheduledBatch, k: int
    ) -> list[tuple[Sequence, Candidates]]:
        """One forward pass; each sampling row's top-k logits for the CPU to pick from;
        `queued_at` as execute's."""
        logits, seqs = self.logits(sched)
        if logits is None:
            self.queued_at = time.perf_counter()
            return []
        k = min(k, logits.shape[-1])
        temps = [
            1.0 if s.params.is_greedy else max(s.params.temperature, MIN_TEMPERATURE) for s in seqs
        ]
        t = upload(torch.tensor(temps), logits.device)[:, None]
        vals, ids = logits.topk(k, dim=-1)  # [N, k], largest first
        lse = torch.logsumexp(logits, -1, keepdim=True)
        lse_t = torch.logsumexp(logits / t, -1, keepdim=True)
        self.queued_at = time.perf_counter()
        floats = torch.cat([vals, lse, lse_t], dim=-1).cpu().numpy()  # the step's sync
        ids_host = ids.to(torch.int32).cpu().numpy()
        return [
            (
                seq,
                Candidates(
                    ids_host[i], floats[i, :k], float(floats[i, k]), float(floats[i, k + 1])
                ),
            )
            for i, seq in enumerate(seqs)
        ]

    def _decode_logits_any(self, ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        if self.graphs is not None and len(ids) <= self.graphs.max_batch:
            return self.graphs.run(ids, batch)
        return self._decode_logits(ids, batch)

    def _advance(self, batch: AttentionBatch) -> AttentionBatch:
        """The decode batch one token later: every sequence gained the token just sampled,
        whose Hot index is the Hot key count before it (a Warm prefix is whole blocks)."""
        bs = self.block_size
        hot = batch.seq_lens.long()
        blocks = batch.block_tables.gather(1, (hot // bs).unsqueeze(1)).squeeze(1)
        return AttentionBatch(
            positions=batch.positions + 1,
            slot_mapping=blocks.long() * bs + hot % bs,
            block_tables=batch.block_tables,
            seq_lens=batch.seq_lens + 1,
            num_decode=batch.num_decode,
            query_start_loc=batch.query_start_loc,
            seq_lens_host=[n + 1 for n in batch.seq_lens_host],
        )

    def _sampling_batch(
        self, seqs: list[Sequence], steps: list[int] | None = None
    ) -> SamplingBatch:
        """Each row's sampling; its step (which picks its seeded noise) is `steps`, by default
        its sequence's output tokens so far."""
        params = [s.params for s in seqs]
        penalties = any(has_penalty(p) for p in params)
        return SamplingBatch.build(
            params,
            seeds=[s.seed for s in seqs],
            steps=[s.num_output_tokens for s in seqs] if steps is None else steps,
            prompt_ids=[s.token_ids[: s.prompt_len] for s in seqs] if penalties else None,
            output_ids=[s.output_ids for s in seqs] if penalties else None,
            vocab_size=self.spec.vocab_size,
            device=self.device,
        )

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
        """The rows' tokens, sampled and read back; `queued_at` is set between the two."""
        out = self.sampler(logits, self._sampling_batch(seqs))
        self.queued_at = time.perf_counter()
        return self._to_host(out, seqs)

    def _to_host(self, out: SamplerOutput, seqs: list[Sequence]) -> list[Sampled]:
        """Read sampled ids (and logprobs) back: the step's one synchronisation."""
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top = None
        if out.top_logprobs is not None:
            top = list(zip(out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist(), strict=True))
        result = []
        for i, seq in enumerate(seqs):
            n = seq.params.logprobs
            lp = logprobs[i] if (n is not None and logprobs is not None) else None
            tp = None
            if n and top is not None:
                ids, vals = top[i]
                tp = list(zip(ids[:n], vals[:n], strict=True))
            result.append(Sampled(seq, token_ids[i], lp, tp))
        return result


def _allocate_kv(
    spec: ModelSpec, num_blocks: int, block_size: int, device: torch.device, hot_codec: str
) -> list[ops.KvCache]:
    """Each layer's Hot-KV: native K and V views of one [L, 2, N, S, Hkv, D] tensor (MLA:
    [L, 1, ...], K and V the same view: spec.kv_copies), or an int8/int4 QuantKvCache
    (kernels/kv_quant.py) per layer."""
    if hot_codec == "native":
        n = spec.kv_copies
        shape = (spec.num_layers, n, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        kv = torch.empty(shape, dtype=spec.dtype, device=device)
        return [(kv[i, 0], kv[i, n - 1]) for i in range(spec.num_layers)]
    codec: Literal["int8", "int4"] = "int8" if hot_codec == "int8" else "int4"
    return [
        QuantKvCache.empty(codec, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, device)
        for _ in range(spec.num_layers)
    ]


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


class _Pending:
    """One step's sampled results on their way to the host: copied into pinned memory
    behind an event on the device (synchronous on the CPU)."""

    def __init__(self, out: SamplerOutput, event: torch.cuda.Event | None) -> None:
        self.out, self.event = out, event

    @classmethod
    def start(cls, out: SamplerOutput) -> _Pending:
        if not out.token_ids.is_cuda:
            return cls(out, None)

        def host(t: torch.Tensor) -> torch.Tensor:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return buf.copy_(t, non_blocking=True)

        tops = out.top_logprobs
        copied = SamplerOutput(
            host(out.token_ids),
            None if out.logprobs is None else host(out.logprobs),
            None if tops is None else (host(tops[0]), host(tops[1])),
        )
        event = torch.cuda.Event()
        event.record()
        return cls(copied, event)

    def wait(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        return self.out


@torch.inference_mode()
def profile_step_peak(
    model: CausalLM,
    tokens: int,
    seqs: int,
    block_size: int,
    device: torch.device,
    context: int,
    hot_codec: str = "native",
) -> int:
    """Device bytes the worst step allocates beyond weights and KV (CUDA allocator stats): a
    prefill chunk of `tokens` tokens at the end of a `context`-token sequence (attending all
    its keys, through the Hot codec's kernels), then sampling `seqs` rows with every sampler
    feature on. The chunk's blocks stand in for the whole context's (their keys are
    whatever they hold: only the allocations count)."""
    spec = model.spec
    blocks = -(-tokens // block_size)
    context = max(context, tokens)
    runner = ModelRunner(
        model, spec, blocks, block_size, context, device, graph_batch=0, hot_codec=hot_codec
    )
    params = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.01,
        logprobs=5,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        max_tokens=1,
    )
    seq = Sequence("profile", context, [0] * context, params, 0, 0)
    seq.num_computed_tokens = context - tokens
    seq.block_ids = [i % blocks for i in range(-(-context // block_size))]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    logits, _ = runner.logits(ScheduledBatch([seq], [tokens]))
    assert logits is not None
    runner._sample(logits.expand(seqs, -1).contiguous(), [seq] * seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del runner, logits
    torch.cuda.empty_cache()
    return peak
