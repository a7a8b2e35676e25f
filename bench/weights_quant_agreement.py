"""int8 / int4 dense weights (weights.format) against fp32 and bf16 on SmolLM2-135M-Instruct:
greedy agreement and logit error. CPU, a few minutes.

    .venv/bin/python bench/weights_quant_agreement.py --out bench/results/weights_quant_cpu.json

The reference is the GGUF dequantized to fp32 (what transformers loads from the file, and
what the engine decodes token for token, tests/test_gguf_serving.py). Each variant holds the
weights our formats hold, dequantized (models/dense_quant.py), in transformers' Llama, so that
one forward pass scores every position; the engine's kernels multiply the same values (in
another summation order). Variants:
    bf16           the reference in bfloat16
    int8           per output channel, quantized from the reference weights
    int4           groups of 64 with a scale and a zero, quantized from the reference weights
    int4_repacked  the file's own Q4_1 blocks repacked (weights.format int4 on this file):
                   the same values as the reference
    int4_repacked_x8  those blocks times x rounded to int8 a 32-input run, as the device's
                   int8-activation GEMV multiplies them at one row (triton_dense_quant
                   `_int4_gemv_dp4a`; reference.int8_runs): y = int8_runs(x) (c s) + x z.
                   Here every row is rounded, prompt rows too (the device rounds decode rows
                   only): an upper bound on what it changes.
Figures per variant over --prompts chat prompts: top-1 agreement teacher-forced along the
reference's greedy continuation (--tokens), the relative logit error there
(||l - l_ref|| / ||l_ref||), and free-running greedy: how many of the first --free-tokens
tokens equal the reference's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridgen.benchmarks.report import machine_info
from hybridgen.kernels import reference
from hybridgen.models.default_model import DEFAULT_MODEL, resolve_model
from hybridgen.models.dense_quant import from_gguf_blocks, quantize
from hybridgen.models.loader import open_gguf

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Give me a tip for learning a new language.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.",
]
VARIANTS = ("bf16", "int8", "int4", "int4_repacked", "int4_repacked_x8")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_reference(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return tok, model.eval()


@torch.no_grad()
def variant(reference: Any, name: str, path: Path) -> Any:
    """A copy of the reference model holding the weights of variant `name`."""
    import copy

    model = copy.deepcopy(reference)
    if name == "bf16":
        return model.to(torch.bfloat16)
    stored = {}
    if name.startswith("int4_repacked"):
        f = open_gguf(str(path))
        stored = {n: from_gguf_blocks(t.qtype, t.data) for n, t in f.tensors(f.spec())}
    for full, module in model.named_modules():
        if full.rsplit(".", 1)[-1] not in LINEARS:
            continue
        if name.startswith("int4_repacked"):
            qw = stored[f"{full}.weight"]
            assert qw is not None and qw.fmt == "int4"
        else:
            qw = quantize(module.weight, name)
        module.weight.copy_(qw.dequantize(torch.float32))
        if name == "int4_repacked_x8":
            assert qw.zero is not None
            zero = qw.zero.float().repeat_interleave(qw.group, 1)
            module.register_forward_hook(_int8_activation_hook(zero))
    return model


def _int8_activation_hook(zero: torch.Tensor) -> Any:
    """A linear's forward hook: its output as the int8-activation GEMV computes it, the codes
    times x rounded (int8_runs), the zeros times x: y + (x_hat - x) (W - zero)."""

    def hook(module: Any, args: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        delta = reference.int8_runs(flat).to(flat.dtype) - flat
        return y + (delta @ (module.weight - zero).T).reshape(y.shape)

    return hook


@torch.no_grad()
def score(
    model: Any, ref: Any, prompts: list[list[int]], conts: list[list[int]], free_tokens: int
) -> dict:
    agree, total, errs, prefix = 0, 0, [], []
    for p, c in zip(prompts, conts, strict=True):
        ids = torch.tensor([p + c])
        want = ref(ids).logits[0, len(p) - 1 : -1].float()
        got = model(ids).logits[0, len(p) - 1 : -1].float()
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(c)
        errs += ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
        free = greedy(model, p, free_tokens)
        same = next(
            (i for i, (a, b) in enumerate(zip(free, c, strict=False)) if a != b), free_tokens
        )
        prefix.append(same)
    return {
        "teacher_forced_top1_agreement": agree / total,
        "rel_logit_err_mean": sum(errs) / len(errs),
        "rel_logit_err_max": max(errs),
        "free_greedy_same_prefix": prefix,
    }


@torch.no_grad()
def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a llama-architecture GGUF")
    ap.add_argument("--tokens", type=int, default=128, help="reference continuation length")
    ap.add_argument("--free-tokens", type=int, default=64, help="free-running greedy length")
    ap.add_argument("--prompts", type=int, default=len(QUESTIONS))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    ap.add_argument("--out", type=Path, default=Path("bench/results/weights_quant_cpu.json"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    path = Path(resolve_model(args.model))
    tok, ref = load_reference(path)
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for q in QUESTIONS[: args.prompts]
    ]
    conts = [greedy(ref, p, args.tokens) for p in prompts]
    result: dict[str, Any] = {
        "machine": machine_info(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "command": " ".join(["python", *sys.argv]),
        "model": path.name,
        "reference": "fp32 (the GGUF dequantized)",
        "prompts": args.prompts,
        "continuation_tokens": args.tokens,
        "free_tokens": args.free_tokens,
        "variants": {},
    }
    for name in args.variants.split(","):
        start = time.perf_counter()
        scored = score(variant(ref, name, path), ref, prompts, conts, args.free_tokens)
        result["variants"][name] = {**scored, "seconds": round(time.perf_counter() - start, 1)}
        print(name, json.dumps(result["variants"][name]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)  # written after every variant
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
