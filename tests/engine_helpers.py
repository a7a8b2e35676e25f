"""A small CPU engine for the Warm-tier, degrade and tuning tests: 8-token blocks, 32-token
steps and lossless Warm records, so a few short prompts already spill out of a tiny Hot pool;
and the tokens such an engine must give."""

from __future__ import annotations

from pathlib import Path

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.sampling.params import SamplingParams
from tests.hf_reference import hf_greedy


def small_engine(path: Path, **options: object) -> Engine:
    defaults: dict[str, object] = {
        "max_num_seqs": 4,
        "warm_codec": "lossless",
        "max_model_len": 256,
        "max_num_batched_tokens": 32,
    }
    config = EngineConfig(
        model=str(path),
        device="cpu",
        block_size=8,
        **{**defaults, **options},  # type: ignore[arg-type]
    )
    return Engine(config)


def reference_tokens(
    path: Path, prompts: list[list[int]], hot_codec: str, new: int
) -> list[list[int]]:
    """The greedy tokens a budgeted engine must give: HF's with a native Hot cache, else those
    of the same quantized Hot cache with no budget (its quantization is the only change)."""
    if hot_codec == "native":
        return hf_greedy(path, prompts, new)
    engine = small_engine(path, hot_codec=hot_codec)
    greedy = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    tokens = [c.token_ids for c in engine.generate(prompts, greedy)]
    engine.release()
    return tokens
