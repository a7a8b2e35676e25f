"""HybridGen against llama.cpp (llama-cpp-python) on the same GGUF, in one run on the CPU:
greedy tokens (where they diverge) and decode tok/s at batch 1, side by side.

    CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install llama-cpp-python==0.3.36   # builds
    .venv/bin/python bench/llamacpp_compare.py --out bench/results/llamacpp_cpu.json

Both get the same prompt token ids (the chat template applied by HybridGen's tokenizer), the
same thread count, and greedy decoding without penalties. HybridGen runs the GGUF
dequantized to fp32 (what it serves on a CPU); llama.cpp multiplies the quantized blocks
(Q4_1 here) directly, so their logits differ by the quantization of the activations llama.cpp
does and by summation order: expect agreement over the first tokens and a divergence later.
Decode tok/s is generated tokens after the first over their time (the prefill excluded).
Not a CI test: it needs the llama-cpp-python build and minutes of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridgen.benchmarks.engine_bench import timed_run
from hybridgen.benchmarks.report import machine_info
from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.models.chat import ChatMessage, chat_prompt_ids
from hybridgen.models.default_model import DEFAULT_MODEL, resolve_model
from hybridgen.sampling.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
]


def ours(model: str, prompts: list[list[int]], new: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=model, device="cpu", max_model_len=1024, prefix_reuse=False))
    greedy = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    tokens = [c.token_ids for c in engine.generate(prompts, greedy)]
    rates = [timed_run(engine, [p], new).decode_tok_s for p in prompts]
    engine.release()
    return {"tokens": tokens, "decode_tok_s": rates}


def llama_cpp(path: str, prompts: list[list[int]], new: int, threads: int) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    tokens, rates = [], []
    for p in prompts:
        llm.reset()
        out, stamps = [], []
        for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(t))
            stamps.append(time.perf_counter())
            if len(out) == new:
                break
        tokens.append(out)
        rates.append((len(out) - 1) / (stamps[-1] - stamps[0]))
    return {"tokens": tokens, "decode_tok_s": rates, "version": _version()}


def _version() -> str:
    import llama_cpp

    return str(llama_cpp.__version__)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/llamacpp_cpu.json"))
    args = ap.parse_args(argv)
    path = resolve_model(args.model)
    from hybridgen.models.tokenizer_source import load_tokenizer

    tok = load_tokenizer(path)
    prompts = [chat_prompt_ids(tok, [ChatMessage("user", q)]) for q in QUESTIONS]
    a = ours(path, prompts, args.new_tokens, args.threads)
    b = llama_cpp(path, prompts, args.new_tokens, args.threads)
    rows = [
        {
            "question": q,
            "prompt_tokens": len(p),
            "agreed_tokens": first_divergence(x, y),
            "hybridgen_text": tok.decode(x, skip_special_tokens=True),
            "llamacpp_text": tok.decode(y, skip_special_tokens=True),
            "hybridgen_decode_tok_s": round(ra, 1),
            "llamacpp_decode_tok_s": round(rb, 1),
        }
        for q, p, x, y, ra, rb in zip(
            QUESTIONS,
            prompts,
            a["tokens"],
            b["tokens"],
            a["decode_tok_s"],
            b["decode_tok_s"],
            strict=True,
        )
    ]
    result = {
        "machine": machine_info(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "command": " ".join(["python", *sys.argv]),
        "model": Path(path).name,
        "threads": args.threads,
        "load_average_1_5_15_min": os.getloadavg(),
        "new_tokens": args.new_tokens,
        "llama_cpp_python": b["version"],
        "hybridgen_dtype": "float32 (GGUF dequantized at load)",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    for r in rows:
        print(json.dumps(r, ensure_ascii=False))


if __name__ == "__main__":
    main()
