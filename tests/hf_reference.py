"""HF transformers as the reference: greedy continuations, logits and margins of a tiny
checkpoint, plus deterministic prompts for it."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from tests.checkpoints import CORPUS


@functools.lru_cache(maxsize=4)
def _load_model(directory: str, stamp: int) -> Any:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    del stamp  # part of the cache key only: a rebuilt directory is reloaded
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    # generate() fills unset options from model.generation_config, so EOS (and any sampling or
    # repetition-penalty default) is only really off when the model's own config is neutral.
    model.generation_config = GenerationConfig()
    return model.eval()


def hf_model(directory: Path) -> Any:
    """The checkpoint in transformers, fp32, eager attention (cached per directory build)."""
    stamp = (Path(directory) / "config.json").stat().st_mtime_ns
    return _load_model(str(Path(directory).resolve()), stamp)


@torch.no_grad()
def hf_greedy(directory: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, exactly max_new_tokens ids each."""
    from transformers import GenerationConfig

    model = hf_model(directory)
    config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        new = out[0, len(prompt) :].tolist()
        if len(new) != max_new_tokens:
            raise AssertionError(f"generate returned {len(new)} tokens, wanted {max_new_tokens}")
        outputs.append(new)
    return outputs


@torch.no_grad()
def hf_logits(directory: Path, prompt_ids: list[int]) -> torch.Tensor:
    """fp32 logits at the last prompt position, shape [vocab]."""
    model = hf_model(directory)
    logits = model(torch.tensor([prompt_ids], dtype=torch.long)).logits
    return logits[0, -1].float()


@torch.no_grad()
def hf_margins(directory: Path, prompt: list[int], new_tokens: list[int]) -> list[float]:
    """Top-1 minus top-2 logit at each step of a greedy continuation (one teacher-forced pass).

    Lets a comparison tell a real mismatch from a near-tie that any rounding difference flips.
    """
    model = hf_model(directory)
    ids = torch.tensor([prompt + new_tokens[:-1]], dtype=torch.long)
    logits = model(ids).logits[0, len(prompt) - 1 :].float()
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def sample_prompts(tokenizer_dir: Path, n: int, lengths: int | Sequence[int]) -> list[list[int]]:
    """`n` deterministic prompts of CORPUS tokens; prompt i has lengths[i % len(lengths)] ids.

    Each starts with what the tokenizer's post-processor puts first (BOS, or nothing for qwen2).
    """
    backend = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    prefix = backend.encode("", add_special_tokens=True).ids
    text_ids = backend.encode(CORPUS, add_special_tokens=False).ids
    sizes = [lengths] if isinstance(lengths, int) else list(lengths)
    prompts = []
    for i in range(n):
        length = sizes[i % len(sizes)]
        start = (i * 37) % len(text_ids)  # different text for every prompt
        body = [text_ids[(start + j) % len(text_ids)] for j in range(length)]
        prompts.append([*prefix, *body][:length])
    return prompts
