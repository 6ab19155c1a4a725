"""The `tokenwire` command line against a real server."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping
from tokenwire.server.app import TokenwireServer
from tokenwire.server.cli import main


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_generate_streams_text_on_stdout_and_the_timeline_on_stderr_by_default(
    server: TokenwireServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await run_cli(
        capsys,
        "generate",
        "--server",
        f"127.0.0.1:{server.port}",
        "--stream",
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "Hello, world!",
    )
    assert code == 0
    assert out.strip() and "timeline" not in out
    _, _, timeline = err.partition("--- timeline")
    for label in ("queued", "first token", "decoding", "total"):
        assert label in timeline
    assert re.search(r"total\s+[\d.]+ ms for 16 tokens, finish length", timeline)


async def test_generate_unary_text_equals_streamed_text(
    server: TokenwireServer, capsys: pytest.CaptureFixture[str]
) -> None:
    common = (
        "--server",
        f"127.0.0.1:{server.port}",
        "--temperature",
        "0",
        "--max-new-tokens",
        "10",
        "--ignore-eos",
        "The capital of France is",
    )
    _, streamed, streamed_err = await run_cli(capsys, "generate", "--stream", "--no-timeline", *common)
    _, unary, unary_err = await run_cli(capsys, "generate", *common)
    assert streamed == unary
    assert "timeline" not in streamed_err + unary_err


async def test_generate_reports_bad_flags_with_the_field(
    server: TokenwireServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await run_cli(
        capsys, "generate", "--server", f"127.0.0.1:{server.port}", "--top-p", "3", "x"
    )
    assert code == 1
    assert "INVALID_ARGUMENT" in err and "sampling.top_p" in err


async def test_generate_shapes_the_output_with_json_schema_regex_or_choice(
    server: TokenwireServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    common = (
        "generate",
        "--server",
        f"127.0.0.1:{server.port}",
        "--raw",
        "--temperature",
        "1",
        "--seed",
        "3",
    )
    code, out, _ = await run_cli(capsys, *common, "--json-schema", str(schema_file), "Answer:")
    assert code == 0
    jsonschema.validate(json.loads(out), schema)
    code, out, _ = await run_cli(capsys, *common, "--stream", "--regex", "[a-c]{4}", "Answer:")
    assert code == 0 and re.fullmatch("[a-c]{4}", out.strip())
    code, out, _ = await run_cli(capsys, *common, "--choice", "red", "--choice", "green", "Answer:")
    assert code == 0 and out.strip() in ("red", "green")
    code, _, err = await run_cli(capsys, *common, "--regex", "a(", "Answer:")
    assert code == 1 and "response_format.regex" in err
    code, _, err = await run_cli(capsys, *common, "--json-schema", str(tmp_path / "missing.json"), "Answer:")
    assert code == 2 and "--json-schema" in err


async def test_generate_passes_logit_bias_and_penalties(
    server: TokenwireServer, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ("generate", "--server", f"127.0.0.1:{server.port}", "--raw", "--max-new-tokens", "5")
    flags = ("--temperature", "0.7", "--seed", "9", "--ignore-eos", "--presence-penalty", "0.5")
    code, out, _ = await run_cli(
        capsys, *common, *flags, "--frequency-penalty", "1", "--logit-bias", "41=-100", "Once upon"
    )
    assert code == 0
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        reference = await client.generate(
            "Once upon",
            GenerateOptions(
                sampling=Sampling(
                    temperature=0.7,
                    seed=9,
                    presence_penalty=0.5,
                    frequency_penalty=1.0,
                    logit_bias={41: -100.0},
                ),
                stopping=Stopping(max_new_tokens=5, ignore_eos=True),
            ),
        )
        forced = await client.generate(
            "Once upon",
            GenerateOptions(
                sampling=Sampling(temperature=0.0, logit_bias={40: 100.0, 41: -5.0}),
                stopping=Stopping(max_new_tokens=5),
            ),
        )
    assert out == reference.text + "\n"
    assert forced.token_ids == (40,) * 5
    code, out, _ = await run_cli(
        capsys, *common, "--temperature", "0", "--logit-bias", "40=100", "--logit-bias", "41=-5", "Once upon"
    )
    assert code == 0 and out == forced.text + "\n"
    code, _, err = await run_cli(capsys, *common, "--frequency-penalty", "5", "--logit-bias", "9999=1", "x")
    assert code == 1
    assert "sampling.frequency_penalty" in err and "sampling.logit_bias[9999]" in err
    with pytest.raises(SystemExit) as exited:
        await run_cli(capsys, *common, "--logit-bias", "40:100", "x")
    assert exited.value.code == 2
    assert "expected TOKEN_ID=BIAS" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "chat"), [((), True), (("--chat",), True), (("--raw",), False)])
async def test_prompt_goes_through_the_chat_template_unless_raw_is_asked_for(
    server: TokenwireServer, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], chat: bool
) -> None:
    code, _, err = await run_cli(
        capsys,
        "generate",
        "--server",
        f"127.0.0.1:{server.port}",
        "--timeline",
        *flags,
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
        "--ignore-eos",
        "What is gravity?",
    )
    assert code == 0
    tokenizer = server.registry.default.model.tokenizer
    if chat:
        rendered = "<|im_start|>user\nWhat is gravity?<|im_end|>\n<|im_start|>assistant\n"
        prompt_tokens = len(tokenizer.encode(rendered, add_special_tokens=False))
    else:
        prompt_tokens = len(tokenizer.encode("What is gravity?"))
    assert f"prefill of {prompt_tokens} prompt tokens" in err


async def test_the_timeline_shows_prompt_tokens_taken_from_the_prefix_cache(
    server: TokenwireServer, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "A prompt long enough for three cache blocks, sent twice by this test."
    argv = ("generate", "--server", f"127.0.0.1:{server.port}", "--stream", "--raw", "--max-new-tokens", "4")
    code, _, first = await run_cli(capsys, *argv, prompt)
    assert code == 0 and "prefix cache" not in first
    code, _, second = await run_cli(capsys, *argv, prompt)
    assert code == 0
    found = re.search(r"prefill of (\d+) prompt tokens: [\d.]+ ms; (\d+) more from the prefix cache", second)
    assert found is not None, second
    processed, cached = int(found.group(1)), int(found.group(2))
    assert cached > 0 and cached % 16 == 0
    assert f"prefill of {processed + cached} prompt tokens" in first


async def test_models_lists_the_served_model(
    server: TokenwireServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await run_cli(capsys, "models", "--server", f"127.0.0.1:{server.port}")
    assert code == 0
    name, context, *_ = out.strip().split("\t")
    assert name == "tiny" and context == "context 256"
    assert "default" in out and "chat" in out


def test_create_tiny_writes_a_loadable_model(tmp_path: Path) -> None:
    for layout in ("optimum", "gqa"):
        out = tmp_path / layout
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "tokenwire.server.cli",
                "model",
                "create-tiny",
                str(out),
                "--layout",
                layout,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        assert Path(result.stdout.strip()) == out
        assert (out / "tokenizer.json").is_file()
        assert (out / ("model.onnx" if layout == "optimum" else "genai_config.json")).is_file()


def test_serve_rejects_bad_settings_with_the_flag_named(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenwire.server.cli",
            "serve",
            "--model",
            str(tmp_path / "missing"),
            "--max-batch-size",
            "0",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "--max-batch-size" in result.stderr and "--model" in result.stderr


async def test_generate_prints_each_of_n_completions_after_a_line_naming_it(
    server: TokenwireServer, capsys: pytest.CaptureFixture[str]
) -> None:
    common = (
        "--server",
        f"127.0.0.1:{server.port}",
        "--raw",
        "--temperature",
        "1",
        "--seed",
        "7",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--n",
        "3",
        "Once upon a time",
    )
    code, unary, _ = await run_cli(capsys, "generate", *common)
    assert code == 0
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        expected = await client.generate(
            "Once upon a time",
            GenerateOptions(
                sampling=Sampling(temperature=1.0, seed=7),
                stopping=Stopping(max_new_tokens=6, ignore_eos=True),
                n=3,
            ),
        )
    assert len(expected.choices) == 3
    assert unary == "".join(
        f"--- completion {c.index}, finish length ---\n{c.text}\n" for c in expected.choices
    )

    code, streamed, err = await run_cli(capsys, "generate", "--stream", *common)
    assert code == 0
    # Each run of one completion's text follows [i]; put together, each is the unary text.
    runs = re.split(r"(?:^|\n)\[(\d+)\] ", streamed.removesuffix("\n"))
    assert runs[0] == ""
    texts = dict.fromkeys(range(3), "")
    for index, text in zip(runs[1::2], runs[2::2], strict=True):
        texts[int(index)] += text
    assert texts == {c.index: c.text for c in expected.choices}
    assert re.search(r"for 18 tokens, finish 0: length, 1: length, 2: length", err)
