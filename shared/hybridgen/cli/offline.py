"""Generate in-process with the engine, streaming tokens to the terminal (no server needed).

python -m hybridgen.cli.offline "Hello, world"      # the default model, as `hybridgen serve`
"""

from __future__ import annotations

import argparse
import sys

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.validation import InvalidRequest
from hybridgen.models.default_model import DEFAULT_MODEL
from hybridgen.runtime import log
from hybridgen.sampling.params import InvalidSamplingParameter, SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument(
        "--model", default=DEFAULT_MODEL, help="checkpoint directory, GGUF file or preset"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gpu-memory-mb", type=int, default=None)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    args = ap.parse_args(argv)
    log.configure(level="warning")
    engine = Engine(
        EngineConfig(model=args.model, device=args.device, gpu_memory_mb=args.gpu_memory_mb)
    )
    tok = engine.loaded.tokenizer
    prompt = args.prompt
    if args.chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
    )
    prompt_ids = tok.encode(prompt)
    try:
        engine.validate(prompt_ids, params)  # this command is the edge: the engine asserts only
    except (InvalidRequest, InvalidSamplingParameter) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine.add_request("offline", prompt_ids, params)
    if engine.spec.synthetic:
        print(f"[{engine.spec.name}: synthetic preset, random weights]", file=sys.stderr)
    ids: list[int] = []
    shown = ""
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            text = tok.decode(ids, skip_special_tokens=True)
            # Print only what is stable: a trailing replacement char may be half a UTF-8 char.
            stable = text.rstrip("\ufffd")
            print(stable[len(shown) :], end="", flush=True)
            shown = stable
            if out.finished:
                print(
                    f"\n[finish_reason={out.finish_reason.value if out.finish_reason else ''}"
                    f" tokens={out.output_tokens}]",
                    file=sys.stderr,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
