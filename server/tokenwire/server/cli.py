"""The `tokenwire` command: serve, generate, models, bench, pull, convert, model create-tiny."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokenwire.client import cli as client_cli
from tokenwire.server import settings_sources
from tokenwire.server.config import ModelSource, is_gguf_file

if TYPE_CHECKING:
    from tokenwire.server.model_tools.convert.lora_graph import LoraOptions

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


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve models over gRPC",
        description="Serve models over gRPC. Each setting comes from its flag, else its environment "
        "variable (shown in brackets), else the --config TOML file (the flag's name with underscores as "
        "the key), else its default. Bearer tokens come only from --auth-tokens-file and "
        "TOKENWIRE_AUTH_TOKENS.",
    )
    settings_sources.add_arguments(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_sources.load(args, os.environ)
    except settings_sources.SettingsError as error:
        for problem in error.problems:
            print(f"tokenwire serve: {problem}", file=sys.stderr)
        return 2
    from tokenwire.server.telemetry.logs import configure_logging

    configure_logging(settings.telemetry.log_level, settings.telemetry.log_format)
    from tokenwire.server.models.runtime_check import runtime_problems

    # Before any download or model load: ONNX Runtime itself falls back to the CPU with only a
    # warning in the log when CUDA cannot load.
    problems = runtime_problems(settings.device)
    if problems:
        device = settings.device
        print(f"tokenwire serve: ONNX Runtime cannot run with --device {device} here", file=sys.stderr)
        for found in problems:
            print(f"  missing: {found.missing}\n  fix: {found.fix}", file=sys.stderr)
        return 1
    from tokenwire.server.models.runtime_check import CUDA_PROVIDER
    from tokenwire.server.models.session import choose_provider

    # GroupQueryAttention on CUDA is half precision only: a GPU gets the float16 export.
    dtype = "float16" if choose_provider(settings.device) == CUDA_PROVIDER else "float32"
    modules = settings.lora_module_names
    try:
        # Adapters need a graph with LoRA sites: a GGUF file is converted with them then.
        settings = replace(
            settings, models=_servable(settings.models, dtype, lora=bool(settings.loras), modules=modules)
        )
        if not settings.models:
            from tokenwire.server.model_tools.pull import known_model, pull_model

            # The names are checked against the model's family before anything is downloaded.
            lora = _lora_options(known_model(DEFAULT_MODEL).architecture, modules) if settings.loras else None
            pulled = pull_model(DEFAULT_MODEL, dtype=dtype, lora=lora)
            settings = replace(settings, models=(ModelSource(pulled, DEFAULT_MODEL),))
    except _ModelRefusedError as refused:
        print(f"tokenwire serve: {refused}", file=sys.stderr)
        return 2
    from tokenwire.server.main import run

    return run(settings)


class _ModelRefusedError(Exception):
    """A --model that cannot be served as asked (a GGUF file that cannot be converted, or module
    names its family lacks): one line names the flag and why."""


def _servable(
    models: tuple[ModelSource, ...], dtype: str, *, lora: bool, modules: tuple[str, ...] | None = None
) -> tuple[ModelSource, ...]:
    """The models with each GGUF file replaced by its converted directory (converted on first
    use, cached in the user cache), served under the file's name without .gguf.

    With `lora`, the files are converted with LoRA sites on `modules` (--lora-modules; None:
    every projection). Every file's names are checked against its family before any file is
    converted, so a bad name costs no conversion.
    """
    if lora and modules is not None and models and not is_gguf_file(models[0].path):
        _check_built_sites(models[0].path, modules)
    if not any(is_gguf_file(source.path) for source in models):
        return models
    from tokenwire.server.model_tools.convert import ConversionError
    from tokenwire.server.model_tools.convert.gguf_source import gguf_architecture
    from tokenwire.server.model_tools.convert.lora_graph import LoraOptions
    from tokenwire.server.model_tools.pull import converted_gguf

    planned: list[tuple[ModelSource, LoraOptions | None]] = []
    for source in models:
        options = None
        if lora and is_gguf_file(source.path):
            options = LoraOptions()
            if modules is not None:
                try:
                    architecture = gguf_architecture(source.path)
                except ConversionError as error:
                    raise _ModelRefusedError(f"--model: {error}") from None
                options = _lora_options(architecture, modules)
        planned.append((source, options))
    servable = []
    for source, options in planned:
        if not is_gguf_file(source.path):
            servable.append(source)
            continue
        try:
            directory = converted_gguf(source.path, progress=sys.stderr.isatty(), dtype=dtype, lora=options)
        except (ConversionError, OSError) as error:
            raise _ModelRefusedError(f"--model: {error}") from None
        servable.append(ModelSource(directory, source.name or source.path.stem))
    return tuple(servable)


def _lora_options(architecture: str, modules: tuple[str, ...] | None) -> LoraOptions:
    from tokenwire.server.model_tools.convert.lora_graph import lora_options_for

    try:
        return lora_options_for(architecture, modules)
    except ValueError as error:
        raise _ModelRefusedError(f"--lora-modules: {error}") from None


def _check_built_sites(directory: Path, modules: tuple[str, ...]) -> None:
    """Refuse --lora-modules for a model directory unless its graph has those very sites.

    A directory's sites were fixed when it was built; --lora-modules can only choose them for a
    conversion. A directory converted with the same modules is served as it is (conversion.json
    records which), so a graph converted for these modules earlier can be given directly.
    """
    from tokenwire.server.model_tools.convert.converter import converted_lora
    from tokenwire.server.model_tools.convert.lora_graph import PROJECTIONS

    recorded = converted_lora(directory)
    if recorded is not None:
        wanted = _lora_options(recorded.architecture, modules).modules
        if set(wanted or PROJECTIONS) == set(recorded.modules or PROJECTIONS):
            return
        has = "every projection" if recorded.modules is None else ", ".join(sorted(recorded.modules))
    else:
        has = "none recorded"
    raise _ModelRefusedError(
        f"--lora-modules: {directory} is a model directory, whose LoRA sites were chosen when it was "
        f"built (sites: {has}); --lora-modules chooses them only for a GGUF --model or the default "
        "model: leave it out, or serve the GGUF file"
    )


def _add_pull(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pull = commands.add_parser("pull", help="fetch and convert a known model into the local cache")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL, help="model to pull")
    pull.add_argument(
        "--dtype",
        choices=("float32", "float16"),
        default="float32",
        help="activation and KV-cache type; CUDA needs float16 (its GroupQueryAttention is half precision)",
    )
    pull.set_defaults(handler=_pull)


def _pull(args: argparse.Namespace) -> int:
    from tokenwire.server.model_tools.pull import pull_model

    print(pull_model(args.name, dtype=args.dtype))
    return 0


def _add_convert(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    convert = commands.add_parser("convert", help="convert model files into a servable directory")
    kinds = convert.add_subparsers(title="source formats", metavar="FORMAT")
    gguf = kinds.add_parser(
        "gguf", help="convert a GGUF file: llama, mistral, qwen2, qwen3, gemma2, gemma3 or phi3"
    )
    gguf.add_argument("file", type=Path)
    gguf.add_argument("out_dir", type=Path)
    gguf.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="activation/KV type")
    gguf.set_defaults(handler=_convert_gguf)


def _convert_gguf(args: argparse.Namespace) -> int:
    from tokenwire.server.model_tools.convert import ConversionError, convert_gguf

    try:
        print(convert_gguf(args.file, args.out_dir, dtype=args.dtype))
    except ConversionError as error:
        # A file the converter refuses is the user's input, not a bug: one line, no traceback.
        print(f"tokenwire convert gguf: {error}", file=sys.stderr)
        return 2
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
        from tokenwire.server.model_tools.tiny_llama import create_tiny_llama

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
        from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt

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
