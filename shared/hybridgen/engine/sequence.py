"""A request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hybridgen.engine.block_hash import chain_hash
from hybridgen.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended: the one spelling from the engine to the edge, where the API's
    enum (serving/service.py) and OpenAI's strings (serving/openai_response.py) map it."""

    STOP = "stop"
    """An EOS or stop token was sampled."""
    LENGTH = "length"
    """max_tokens or the model's context length was reached."""
    STOP_SEQUENCE = "stop_sequence"
    """A stop string matched the text (found where the text is made, not by the engine)."""
    CANCELLED = "cancelled"
    """The client went away or cancelled, or the request's step failed."""


@dataclass
class Sequence:
    """One request. Invariant: num_computed_tokens <= len(token_ids), and the KV of exactly
    the first num_computed_tokens tokens sits in `warm_slots` then `block_ids` (in order)."""

    request_id: str
    prompt_len: int
    """Tokens of the prompt; token_ids[prompt_len:] are generated."""
    token_ids: list[int]
    """Prompt followed by generated tokens."""
    params: SamplingParams
    seed: int
    """Sampling seed: the request's, or one drawn at admission."""
    arrival: int
    """Admission order, for FCFS."""
    eos_token_ids: frozenset[int] = frozenset()
    """Ids that end the sequence unless ignore_eos."""
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    """Hot blocks, holding the tokens after the Warm prefix."""
    warm_slots: list[int] = field(default_factory=list)
    """Warm-tier slots holding the KV of its first len(warm_slots) full blocks."""
    warm_copy: list[int] = field(default_factory=list)
    """Warm slots it was loaded back from, still holding copies of its first Hot blocks
    (warm_copy[i] is block_ids[i]): moving those blocks to Warm again takes no copy."""
    turn_start: int = 0
    """Its generated tokens when it was last admitted (time slicing: scheduler.py)."""
    spilled: bool = False
    """Admitted by a spill decision (spill_policy.py): while it runs, Hot blocks move to
    Warm to make room for it, as for a sequence too long for Hot."""
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    logprobs: list[float] = field(default_factory=list)
    """Logprob of each generated token, when requested."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Top-N (id, logprob) of each generated token, when requested."""
    num_preemptions: int = 0
    awaiting_token: bool = False
    """Its candidates went to the CPU daemon; it is not scheduled until the token comes."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of its first full token blocks (engine/block_hash.py), grown on use."""
    num_registered_blocks: int = 0
    """Its first blocks already registered in the pool's prefix cache."""
    prompt_open: bool = False
    """Streaming input: more prompt tokens may still come (Scheduler.extend_prompt). Its last
    token is not computed while the prompt is open, since computing it would sample."""
    prefix_from: tuple[int, int, int] = (0, 0, 0)
    """Blocks of the cached prefix it started from that came from Hot, Warm and Cold."""

    def hashes(self, n: int, block_size: int) -> list[bytes]:
        """The chained hashes of its first `n` full blocks (each computed once, kept in
        `block_hashes`)."""
        hashes = self.block_hashes
        while len(hashes) < n:
            i = len(hashes)
            block = self.token_ids[i * block_size : (i + 1) * block_size]
            hashes.append(chain_hash(hashes[-1] if i else b"", block))
        return hashes[:n]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_computable(self) -> int:
        """Tokens it may compute now: those not computed yet, less the last of an open prompt."""
        return self.num_tokens - self.num_computed_tokens - int(self.prompt_open)

    @property
    def waits_for_prompt(self) -> bool:
        """An open prompt with nothing to compute until more of it comes."""
        return self.prompt_open and self.num_computable <= 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def decode_room(self, max_model_len: int) -> int:
        """Tokens it may still generate from here, or 0 when it is not decoding (more than
        its one pending token is still to compute: a prompt, chunk by chunk)."""
        if self.num_tokens - self.num_computed_tokens != 1:
            return 0
        return min(self.params.max_tokens - self.num_output_tokens, max_model_len - self.num_tokens)

    def append(self, token_id: int, max_model_len: int) -> None:
        """Record a sampled token and decide whether the sequence is finished."""
        self.token_ids.append(token_id)
        p = self.params
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            self.finish_reason = FinishReason.STOP
        elif self.num_output_tokens >= p.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
