"""The `tokenwire` command: serve, generate, models, bench, pull, convert, model create-tiny."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tokenwire.client import cli as client_cli
from tokenwire.server.config import DEFAULT_PORT, ModelSource, ServerSettings
from tokenwire.server.engine.validation import RequestLimits

DEFAULT_MODEL = "smollm2-135m-instruct"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    return int(args.handler(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenwire", description="gRPC inference service for language models"
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_serve(commands)
    client_cli.add_commands(commands)
    _add_pull(commands)
    _add_convert(commands)
    _add_model(commands)
    return parser


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TOKENWIRE_{name}", default)


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve models over gRPC",
        description="Serve models over gRPC. Every flag can also be set with the environment variable "
        "shown in its help (TOKENWIRE_...).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]DIR",
        help="model directory to serve (repeat for several; the first is the default). Without it, the "
        f"default model {DEFAULT_MODEL} is pulled once and served from the cache. TOKENWIRE_MODEL",
    )
    serve.add_argument("--host", default=_env("HOST", "0.0.0.0"), help="address to listen on. TOKENWIRE_HOST")
    serve.add_argument(
        "--port",
        type=int,
        default=int(_env("PORT", str(DEFAULT_PORT))),
        help="port (0 picks one). TOKENWIRE_PORT",
    )
    serve.add_argument(
        "--max-batch-size",
        type=int,
        default=int(_env("MAX_BATCH_SIZE", "8")),
        help="most sequences decoded together; sizes the KV cache. TOKENWIRE_MAX_BATCH_SIZE",
    )
    serve.add_argument(
        "--max-queue-size",
        type=int,
        default=int(_env("MAX_QUEUE_SIZE", "64")),
        help="most requests waiting for a slot; beyond it RESOURCE_EXHAUSTED. TOKENWIRE_MAX_QUEUE_SIZE",
    )
    serve.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=_env("DEVICE", "auto"),
        help="where the model runs; auto picks CUDA when ONNX Runtime has it. TOKENWIRE_DEVICE",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=float(_env("DRAIN_TIMEOUT", "30")),
        help="seconds live requests get to finish after SIGTERM. TOKENWIRE_DRAIN_TIMEOUT",
    )
    serve.add_argument(
        "--max-context-length",
        type=int,
        default=int(_env("MAX_CONTEXT_LENGTH", "2048")),
        help="longest sequence (prompt + output) served; sizes the KV cache. TOKENWIRE_MAX_CONTEXT_LENGTH",
    )
    serve.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=int(_env("PREFILL_CHUNK_SIZE", "256")),
        help="prompt tokens per model call, so long prompts do not stall streams. "
        "TOKENWIRE_PREFILL_CHUNK_SIZE",
    )
    serve.add_argument(
        "--intra-op-threads",
        type=int,
        default=int(_env("INTRA_OP_THREADS", "0")),
        help="ONNX Runtime threads per operator (0: one per core). TOKENWIRE_INTRA_OP_THREADS",
    )
    serve.add_argument(
        "--max-new-tokens-cap",
        type=int,
        default=int(_env("MAX_NEW_TOKENS_CAP", "4096")),
        help="largest max_new_tokens a request may ask for. TOKENWIRE_MAX_NEW_TOKENS_CAP",
    )
    serve.add_argument(
        "--default-max-new-tokens",
        type=int,
        default=int(_env("DEFAULT_MAX_NEW_TOKENS", "256")),
        help="max_new_tokens when a request leaves it unset. TOKENWIRE_DEFAULT_MAX_NEW_TOKENS",
    )
    serve.add_argument(
        "--log-level", default=_env("LOG_LEVEL", "INFO"), help="logging level. TOKENWIRE_LOG_LEVEL"
    )
    serve.set_defaults(handler=_serve)


def _model_sources(values: list[str] | None) -> tuple[ModelSource, ...]:
    if not values:
        env_model = os.environ.get("TOKENWIRE_MODEL")
        values = [env_model] if env_model else []
    sources = []
    for value in values:
        name, sep, path = value.partition("=")
        sources.append(
            ModelSource(Path(path), name) if sep and not Path(value).exists() else ModelSource(Path(value))
        )
    return tuple(sources)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    models = _model_sources(args.model)
    if not models:
        from tokenwire.server.models.pull import pull_model

        models = (ModelSource(pull_model(DEFAULT_MODEL), DEFAULT_MODEL),)
    settings = ServerSettings(
        models=models,
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        max_queue_size=args.max_queue_size,
        prefill_chunk_size=args.prefill_chunk_size,
        max_context_length=args.max_context_length,
        device=args.device,
        intra_op_threads=args.intra_op_threads,
        drain_timeout=args.drain_timeout,
        limits=RequestLimits(
            max_new_tokens_cap=args.max_new_tokens_cap, default_max_new_tokens=args.default_max_new_tokens
        ),
    )
    problems = settings.validate()
    if problems:
        for problem in problems:
            print(f"tokenwire serve: {problem}", file=sys.stderr)
        return 2
    from tokenwire.server.main import run

    return run(settings)


def _add_pull(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pull = commands.add_parser("pull", help="fetch and convert a known model into the local cache")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL, help="model to pull")
    pull.set_defaults(handler=_pull)


def _pull(args: argparse.Namespace) -> int:
    from tokenwire.server.models.pull import pull_model

    print(pull_model(args.name))
    return 0


def _add_convert(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    convert = commands.add_parser("convert", help="convert model files into a servable directory")
    kinds = convert.add_subparsers(title="source formats", metavar="FORMAT")
    gguf = kinds.add_parser("gguf", help="convert a Llama-family GGUF file")
    gguf.add_argument("file", type=Path)
    gguf.add_argument("out_dir", type=Path)
    gguf.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="activation/KV type")
    gguf.set_defaults(handler=_convert_gguf)


def _convert_gguf(args: argparse.Namespace) -> int:
    from tokenwire.server.models.convert import convert_gguf

    print(convert_gguf(args.file, args.out_dir, dtype=args.dtype))
    return 0


def _add_model(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = commands.add_parser("model", help="build models")
    actions = model.add_subparsers(title="actions", metavar="ACTION")
    tiny = actions.add_parser(
        "create-tiny",
        help="build a deterministic tiny random model for tests",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    tiny.add_argument("out_dir", type=Path)
    tiny.add_argument("--layout", choices=("optimum", "gqa"), default="optimum", help="ONNX layout")
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--hidden", type=int, default=64)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2, help="KV heads (gqa layout)")
    tiny.add_argument("--vocab", type=int, default=512)
    tiny.add_argument("--context-length", type=int, default=256)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--no-chat-template", action="store_true", help="leave the chat template out")
    tiny.set_defaults(handler=_create_tiny)


def _create_tiny(args: argparse.Namespace) -> int:
    if args.layout == "gqa":
        from tokenwire.server.models.tiny_llama import create_tiny_llama

        path = create_tiny_llama(
            args.out_dir,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=args.vocab,
            context_length=args.context_length,
            seed=args.seed,
            chat_template=not args.no_chat_template,
        )
    else:
        from tokenwire.server.models.tiny_gpt import TinyGptConfig, create_tiny_gpt

        config = TinyGptConfig(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            vocab=args.vocab,
            context_length=args.context_length,
            seed=args.seed,
        )
        path = create_tiny_gpt(args.out_dir, config, chat_template=not args.no_chat_template)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
