"""A GGUF file's header is believed only within bounds, and its metadata only within its ranges.

Every file here lies about a size: an array of 2^62 items in 60 bytes, nested arrays, a string
past the header bound, 2^24 positions of context, 2^32 - 1 layers, zero heads, a word where a
count belongs, merges of unknown tokens, a tokenizer larger than the model. The real command
(`tokenwire convert gguf`, and `tokenwire serve --model FILE.gguf`) runs in a child whose heap is
capped (RLIMIT_DATA), so a reader that believed the lie fails there instead of taking the
machine; each lie must be refused in one line naming the key, with exit status 2, or (a large
array nobody reads, a context longer than the conversion keeps) converted within bounded memory.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V

from tests.server.model_tools.hostile_gguf import (
    MIB,
    Run,
    array,
    entry,
    raw_gguf,
    rewritten,
    run_bounded,
    string,
)
from tests.server.model_tools.synthetic_gguf import MIXED_FORMATS, SyntheticGguf, write_synthetic_gguf
from tokenwire.server.model_tools.convert.gguf_file import MAX_HEADER_BYTES, GgufArray, open_gguf
from tokenwire.server.model_tools.convert.gguf_source import MAX_CONTEXT_POSITIONS

PEAK_RSS_BOUND = 400 * MIB
"""Converting the small synthetic file peaks near 90 MiB (the interpreter and its libraries); a
reader that decoded any lie would need gigabytes."""


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> SyntheticGguf:
    return write_synthetic_gguf(tmp_path_factory.mktemp("bounds") / "llama.gguf", formats=MIXED_FORMATS)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> SyntheticGguf:
    return write_synthetic_gguf(
        tmp_path_factory.mktemp("bounds") / "gemma2.gguf", formats=MIXED_FORMATS, arch="gemma2"
    )


def convert(path: Path, out: Path) -> Run:
    return run_bounded("convert", "gguf", str(path), str(out))


def assert_refused(run: Run, *fragments: str) -> str:
    lines = run.stderr.strip().splitlines()
    assert run.status == 2, run.stderr[-3000:]
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith("tokenwire convert gguf: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert run.peak_rss < PEAK_RSS_BOUND, f"peak RSS {run.peak_rss / MIB:.0f} MiB"
    return lines[0]


# -- the header -----------------------------------------------------------------------------------


def test_an_array_claiming_2_to_the_62_items_in_60_bytes_is_refused_at_once(tmp_path: Path) -> None:
    path = raw_gguf(tmp_path / "claims.gguf", entry("general.huge", V.ARRAY, array(V.UINT8, 2**62)))
    assert path.stat().st_size == 60
    assert_refused(convert(path, tmp_path / "out"), "claims.gguf is truncated or corrupt", "general.huge")


def test_a_string_array_claiming_more_strings_than_the_file_holds_is_refused(tmp_path: Path) -> None:
    items = string("one") + string("two")
    path = raw_gguf(
        tmp_path / "strings.gguf", entry("tokenizer.ggml.tokens", V.ARRAY, array(V.STRING, 2**40, items))
    )
    assert_refused(convert(path, tmp_path / "out"), "tokenizer.ggml.tokens", "1099511627776 strings")


def test_nested_arrays_are_refused_without_recursing(tmp_path: Path) -> None:
    nested = b"".join(array(V.ARRAY, 1) for _ in range(100_000)) + array(V.UINT8, 0)
    path = raw_gguf(tmp_path / "nested.gguf", entry("general.nested", V.ARRAY, nested))
    assert_refused(convert(path, tmp_path / "out"), "general.nested is an array of arrays")


def test_a_header_past_its_bound_is_refused(tmp_path: Path) -> None:
    length = MAX_HEADER_BYTES + 1024
    path = raw_gguf(tmp_path / "long.gguf", entry("general.description", V.STRING, struct.pack("<Q", length)))
    with path.open("ab") as file:
        file.truncate(path.stat().st_size + length)  # a sparse file: the bytes are really there
    assert_refused(convert(path, tmp_path / "out"), "general.description", "32 MiB")


def test_a_large_array_nobody_reads_costs_no_memory(llama: SyntheticGguf, tmp_path: Path) -> None:
    # 20 MB of uint8: as gguf's reader holds it, one numpy object per item (gigabytes).
    path = rewritten(
        llama.path,
        tmp_path / "padded.gguf",
        {"general.padding": (bytes(20_000_000), V.ARRAY, V.UINT8)},
    )
    run = convert(path, tmp_path / "out")
    assert run.status == 0, run.stderr[-3000:]
    assert run.peak_rss < PEAK_RSS_BOUND, f"peak RSS {run.peak_rss / MIB:.0f} MiB"


def test_serve_refuses_a_lying_gguf_file_in_one_line_before_it_grows(tmp_path: Path) -> None:
    path = raw_gguf(tmp_path / "claims.gguf", entry("general.huge", V.ARRAY, array(V.UINT8, 2**62)))
    run = run_bounded(
        "serve",
        "--model",
        str(path),
        "--port",
        "0",
        "--device",
        "cpu",
        env={"TOKENWIRE_HOME": str(tmp_path / "home")},
    )
    lines = run.stderr.strip().splitlines()
    assert run.status == 2 and len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith("tokenwire serve: --model: claims.gguf is truncated or corrupt")
    assert "general.huge" in lines[0]
    assert run.peak_rss < PEAK_RSS_BOUND


# -- metadata against the tensors ------------------------------------------------------------------

U32 = V.UINT32


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        (
            {"llama.attention.head_count": (0, U32, None)},
            ["llama.attention.head_count is 0", "between 1 and 256"],
        ),
        (
            {"llama.block_count": ("abc", V.STRING, None)},
            ["llama.block_count is a string ('abc')", "whole number"],
        ),
        (
            {"llama.block_count": (2**32 - 1, U32, None)},
            ["llama.block_count is 4294967295", "tensors for 2 layers"],
        ),
        ({"llama.embedding_length": (2**30, U32, None)}, ["llama.embedding_length is 1073741824"]),
        (
            {"llama.attention.head_count_kv": (3, U32, None)},
            ["head_count (4) is not a multiple", "head_count_kv (3)"],
        ),
        ({"llama.rope.freq_base": (float("nan"), V.FLOAT32, None)}, ["llama.rope.freq_base is nan"]),
        (
            {"llama.attention.head_count_kv": ([2, 2], V.ARRAY, U32)},
            ["head_count_kv is an array", "not supported"],
        ),
        (
            {"tokenizer.ggml.merges": (["Ġ t", "zz qq"], V.ARRAY, V.STRING)},
            ["tokenizer.ggml.merges[1]", "'zz'"],
        ),
        (
            {"tokenizer.ggml.token_type": ([1, 1, 1], V.ARRAY, V.INT32)},
            ["token_type has 3 items", "must have 512"],
        ),
        (
            {"tokenizer.ggml.tokens": ([f"t{i}" for i in range(1_000_000)], V.ARRAY, V.STRING)},
            ["1000000 tokens", "512 rows", "larger than the model"],
        ),
    ],
    ids=[
        "zero-heads",
        "word-for-a-count",
        "layers-not-there",
        "hidden-unlike-the-embedding",
        "heads-not-grouped",
        "nan-rotary-base",
        "per-layer-kv-heads",
        "merge-of-unknown-tokens",
        "token-types-per-token",
        "tokenizer-larger-than-the-model",
    ],
)
def test_metadata_that_lies_is_refused_naming_its_key(
    changes: dict[str, tuple[object, V, V | None]], fragments: list[str], llama: SyntheticGguf, tmp_path: Path
) -> None:
    path = rewritten(llama.path, tmp_path / "lying.gguf", changes)  # type: ignore[arg-type]
    assert_refused(convert(path, tmp_path / "out"), *fragments)


def test_gemma2_with_2_to_the_32_layers_is_refused_before_its_layer_pattern_is_built(
    gemma2: SyntheticGguf, tmp_path: Path
) -> None:
    path = rewritten(gemma2.path, tmp_path / "layers.gguf", {"gemma2.block_count": (2**32 - 1, U32, None)})
    assert_refused(convert(path, tmp_path / "out"), "gemma2.block_count is 4294967295")


def test_a_context_longer_than_the_conversion_keeps_is_converted_with_the_bound(
    llama: SyntheticGguf, tmp_path: Path
) -> None:
    path = rewritten(llama.path, tmp_path / "long.gguf", {"llama.context_length": (2**24, U32, None)})
    run = convert(path, tmp_path / "out")
    assert run.status == 0, run.stderr[-3000:]
    assert run.peak_rss < PEAK_RSS_BOUND, f"peak RSS {run.peak_rss / MIB:.0f} MiB"
    config = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert config["model"]["context_length"] == MAX_CONTEXT_POSITIONS


# -- what is read is what the file holds -----------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3"])
def test_the_bounded_reader_reads_what_the_gguf_package_reads(arch: str, tmp_path: Path) -> None:
    synthetic = write_synthetic_gguf(tmp_path / f"{arch}.gguf", formats=MIXED_FORMATS, arch=arch)
    _assert_same_as_gguf_package(synthetic.path)


def test_the_bounded_reader_reads_the_default_model_as_the_gguf_package_does(real_gguf: Path) -> None:
    _assert_same_as_gguf_package(real_gguf)


def _assert_same_as_gguf_package(path: Path) -> None:
    theirs = gguf.GGUFReader(path)
    ours = open_gguf(path)
    expected = {
        name: field.contents() for name, field in theirs.fields.items() if not name.startswith("GGUF.")
    }
    got: dict[str, object] = {}
    for name, value in ours.fields.items():
        if isinstance(value, GgufArray):
            got[name] = value.strings() if value.holds_strings else value.numbers().tolist()
        else:
            got[name] = value
    assert got == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type
        assert mine.shape == tuple(int(d) for d in reference.shape)
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        assert np.array_equal(mine.data, reference.data, equal_nan=True)
