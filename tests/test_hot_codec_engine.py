"""The engine with a compressed Hot-KV cache (kv_cache.hot_codec int8 / int4), on the CPU.

The kernels are checked against float64 in test_hot_codec_kernels.py; here the whole model
runs on them. Greedy agreement is teacher-forced: at each of 256 positions of the native
engine's greedy output, does the quantized engine (given the same prefix) pick the same
token? Free-running agreement is not used because one early flip on a random-weight model,
whose logit margins are tiny, makes every later position differ.
"""

from __future__ import annotations

import pytest

from hybridgen.benchmarks.engine_bench import random_prompts
from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.sampling.params import SamplingParams

TOKENS = 256
# Measured on tiny-llama (seed 0 weights, prompt seed 5): int8 0.996, int4 0.85-0.90.
MIN_AGREEMENT = {"int8": 0.97, "int4": 0.75}


def _engine(codec: str) -> Engine:
    return Engine(EngineConfig(model="tiny-llama", device="cpu", hot_codec=codec, kv_pool_mb=2))


@pytest.fixture(scope="module")
def native_run() -> tuple[Engine, list[int], list[int]]:
    engine = _engine("native")
    prompt = random_prompts(1, 100, engine.spec.vocab_size, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return engine, prompt, engine.generate([prompt], params)[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_quantized_hot_kv_agrees_with_native(native_run, codec: str) -> None:  # type: ignore[no-untyped-def]
    native, prompt, reference = native_run
    engine = _engine(codec)
    # The same MiB hold more blocks: fp32 native (this CPU run) vs int8 ~3.8:1, int4 ~6.4:1.
    assert engine.plan.num_blocks >= {"int8": 3.5, "int4": 6.0}[codec] * native.plan.num_blocks
    seq = prompt + reference
    hits = sum(
        int(engine.prompt_logits(seq[: len(prompt) + i]).argmax()) == reference[i]
        for i in range(TOKENS)
    )
    assert hits / TOKENS >= MIN_AGREEMENT[codec]
    # Decode (the paged kernel path) runs on the quantized cache too.
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert len(engine.generate([prompt], params)[0].token_ids) == 16


def test_unknown_hot_codec_is_refused() -> None:
    with pytest.raises(ConfigError, match="hot_codec"):
        EngineConfig(hot_codec="int2")
