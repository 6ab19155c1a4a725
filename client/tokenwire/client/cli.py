"""Client commands of the `tokenwire` CLI: generate, models."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from tokenwire.client.bench import cli as bench_cli
from tokenwire.client.channel import Tls
from tokenwire.client.errors import TokenwireError
from tokenwire.client.sync import Client
from tokenwire.client.types import (
    ChatMessage,
    Chunk,
    Completed,
    Failed,
    GenerateOptions,
    Generation,
    Queued,
    ResponseFormat,
    Sampling,
    Started,
    Stopping,
)

DEFAULT_SERVER = "localhost:50051"


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    generate = commands.add_parser("generate", help="generate text with a running server")
    _add_connection_flags(generate)
    generate.add_argument(
        "prompt",
        help="the user's message for a chat model; the raw prompt text with --raw or a model without one",
    )
    generate.add_argument("--model", default="", help="model name (default: the server's default)")
    form = generate.add_mutually_exclusive_group()
    form.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a chat message (the default when the model has a chat template)",
    )
    form.add_argument("--raw", action="store_true", help="send the prompt text as is, even to a chat model")
    generate.add_argument("--system", help="system message (chat only)")
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.add_argument(
        "--timeline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the text, show on stderr where the time went: queued, first token, token rate,"
        " total (default: on with --stream, off without)",
    )
    generate.add_argument("--temperature", type=float, help="0 = greedy (default: the model's default)")
    generate.add_argument("--top-k", type=int, default=0, help="0 disables")
    generate.add_argument("--top-p", type=float, help="in (0, 1]")
    generate.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]")
    generate.add_argument("--repetition-penalty", type=float, help="> 0; 1 disables")
    generate.add_argument("--seed", type=int, help="seed for reproducible sampling")
    generate.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        type=_token_bias,
        metavar="TOKEN_ID=BIAS",
        help="add BIAS, in [-100, 100], to the logit of token TOKEN_ID: 100 forces it, -100 bans it"
        " (repeatable)",
    )
    generate.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]; subtracted once from each token already generated (default 0)",
    )
    generate.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]; subtracted from each generated token once per time it was generated (default 0)",
    )
    generate.add_argument(
        "--n",
        type=int,
        default=1,
        help="completions of the prompt, 1 to 16, prefilled once (with --seed, completion i samples"
        " with seed + i); each is printed after a line naming it, streamed ones after [i] where"
        " they take turns",
    )
    generate.add_argument("--max-new-tokens", type=int, help="default: the server's default")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    generate.add_argument("--timeout", type=float, help="server-side deadline in seconds")
    shape = generate.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema", type=Path, metavar="FILE", help="the output is JSON valid against this JSON Schema"
    )
    shape.add_argument("--regex", help="the whole output matches this regular expression")
    shape.add_argument(
        "--choice", action="append", metavar="TEXT", help="the output is one of these strings (repeatable)"
    )
    generate.set_defaults(handler=run_generate)

    models = commands.add_parser("models", help="list the models a server serves")
    _add_connection_flags(models)
    models.set_defaults(handler=run_models)
    bench_cli.add_command(commands)


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server", default=os.environ.get("TOKENWIRE_SERVER", DEFAULT_SERVER), help="host:port of the server"
    )
    parser.add_argument("--token", default=os.environ.get("TOKENWIRE_TOKEN"), help="bearer token")
    parser.add_argument("--tls-ca", type=Path, help="CA certificate (PEM) to trust; enables TLS")
    parser.add_argument("--tls-cert", type=Path, help="client certificate (PEM) for mutual TLS")
    parser.add_argument("--tls-key", type=Path, help="client private key (PEM) for mutual TLS")
    parser.add_argument(
        "--tls-server-name",
        help="name to check the server's certificate against, when it differs from --server's host",
    )


def connect(args: argparse.Namespace) -> Client:
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_server_name:
        tls = Tls(
            root_certificates=args.tls_ca.read_bytes() if args.tls_ca else None,
            certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
            private_key=args.tls_key.read_bytes() if args.tls_key else None,
            server_name_override=args.tls_server_name,
        )
    return Client(args.server, token=args.token, tls=tls)


def _options(args: argparse.Namespace) -> GenerateOptions:
    return GenerateOptions(
        model=args.model,
        sampling=Sampling(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            logit_bias=dict(args.logit_bias),
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
        ),
        stopping=Stopping(
            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos
        ),
        timeout=args.timeout,
        response_format=_response_format(args),
        n=args.n,
    )


def _token_bias(text: str) -> tuple[int, float]:
    """TOKEN_ID=BIAS from the command line; the server checks the ranges."""
    token, separator, bias = text.partition("=")
    try:
        if not separator:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOKEN_ID=BIAS, e.g. 198=-100") from None


def _response_format(args: argparse.Namespace) -> ResponseFormat | None:
    if args.json_schema is not None:
        return ResponseFormat(json_schema=args.json_schema.read_text())
    if args.regex is not None:
        return ResponseFormat(regex=args.regex)
    if args.choice:
        return ResponseFormat(choice=tuple(args.choice))
    return None


def run_generate(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        options = _options(args)
    except OSError as error:
        print(f"tokenwire generate: --json-schema: {error}", file=sys.stderr)
        return 2
    # The timeline goes to stderr so that stdout carries the generated text alone.
    timeline = args.stream if args.timeline is None else args.timeline
    try:
        with connect(args) as client:
            prompt: str | list[ChatMessage] = args.prompt
            if _wants_chat(args, client):
                turns = [ChatMessage("system", args.system)] if args.system else []
                prompt = [*turns, ChatMessage("user", args.prompt)]
            sent = time.monotonic()
            if not args.stream:
                generation = client.generate(prompt, options)
                if generation.choices:
                    for choice in generation.choices:
                        out.write(f"--- completion {choice.index}, finish {choice.finish_reason.value} ---\n")
                        out.write(choice.text + "\n")
                else:
                    out.write(generation.text + "\n")
                if timeline:
                    _print_timeline(generation, None, time.monotonic() - sent, sys.stderr)
                return 0
            first_text_at: float | None = None
            queue_position = 0
            writing: int | None = None  # the completion whose text was written last
            for event in client.stream(prompt, options):
                if isinstance(event, Queued):
                    queue_position = event.position
                elif isinstance(event, Chunk):
                    if first_text_at is None:
                        first_text_at = time.monotonic() - sent
                    if args.n > 1 and event.index != writing:
                        # Completions take turns: each run of one's text starts a line naming it.
                        out.write(("" if writing is None else "\n") + f"[{event.index}] ")
                        writing = event.index
                    out.write(event.text)
                    out.flush()
                elif isinstance(event, Failed):
                    raise event.error
                elif isinstance(event, Completed):
                    out.write("\n")
                    out.flush()
                    if timeline:
                        elapsed = time.monotonic() - sent
                        _print_timeline(event.generation, first_text_at, elapsed, sys.stderr, queue_position)
                elif isinstance(event, Started):
                    pass
            return 0
    except TokenwireError as error:
        print(f"tokenwire generate: {error}", file=sys.stderr)
        for violation in error.field_violations:
            print(f"  {violation.field}: {violation.description}", file=sys.stderr)
        if error.retry_after is not None:
            print(f"  retry after {error.retry_after:.2f}s", file=sys.stderr)
        return 1


def _wants_chat(args: argparse.Namespace, client: Client) -> bool:
    """Chat when asked, raw when asked, otherwise chat exactly when the model has a template."""
    if args.chat or args.raw:
        return bool(args.chat)
    models = client.list_models()
    chosen = next((m for m in models if m.name == args.model or (not args.model and m.is_default)), None)
    return chosen is not None and chosen.has_chat_template


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _prefill_text(generation: Generation) -> str:
    t = generation.timing
    cached = generation.cached_prompt_tokens
    processed = generation.prompt_tokens - cached
    text = f"prefill of {processed} prompt tokens: {_ms(t.prefill)}"
    if cached:
        text += f"; {cached} more from the prefix cache"
    if t.paced:
        text += f"; {_ms(t.paced)} paced behind other requests"
    return text


def _print_timeline(
    generation: Generation,
    client_first_token: float | None,
    client_total: float,
    out: TextIO,
    queue_position: int = 0,
) -> None:
    t = generation.timing
    lines = [
        "--- timeline (server clock, from receipt of the request) ---",
        f"validated   accepted at queue position {queue_position}",
        f"queued      {_ms(t.queued)} waiting for a slot",
        f"first token {_ms(t.time_to_first_token)} after receipt ({_prefill_text(generation)})",
        f"decoding    {t.decode_tokens_per_second:.1f} tokens/s ({_ms(t.time_per_output_token)} per token)",
        f"total       {_ms(t.total)} for {generation.completion_tokens} tokens, "
        f"finish {_finishes(generation)}",
        f"client saw  first text after {_ms(client_first_token)}, all after {_ms(client_total)}",
    ]
    out.write("\n".join(lines) + "\n")


def _finishes(generation: Generation) -> str:
    if not generation.choices:
        return generation.finish_reason.value
    return ", ".join(f"{choice.index}: {choice.finish_reason.value}" for choice in generation.choices)


def run_models(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        with connect(args) as client:
            models = client.list_models()
    except TokenwireError as error:
        print(f"tokenwire models: {error}", file=sys.stderr)
        return 1
    for model in models:
        marks = ["default"] if model.is_default else []
        if model.has_chat_template:
            marks.append("chat")
        out.write(
            f"{model.name}\tcontext {model.context_length}\tvocab {model.vocab_size}\t"
            f"batch {model.max_batch_size}\t{model.format}\t{' '.join(marks)}\n"
        )
    return 0
