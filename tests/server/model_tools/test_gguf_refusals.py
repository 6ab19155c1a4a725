"""`tokenwire convert gguf` refuses files it cannot convert with one line and exit status 2.

Each file is a valid synthetic GGUF (synthetic_gguf.py) damaged the way real files are: a wrong
magic, a truncated download, a header whose tensor offsets or shapes lie, or a model, tensor type
or tokenizer the converter does not handle. No refusal may leave anything in the output's parent.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.server.model_tools.synthetic_gguf import MIXED_FORMATS, SyntheticGguf, write_synthetic_gguf
from tokenwire.server import cli
from tokenwire.server.model_tools.convert import convert_gguf


def _tensor_info_positions(path: Path, name: str) -> dict[str, int]:
    """Byte positions of one tensor's dims, type and offset in the file's header."""
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == name)
    position = tensor.field.offset
    starts = []
    for part in tensor.field.parts:
        starts.append(position)
        position += part.nbytes
    return {"dims": starts[3], "type": starts[4], "offset": starts[5]}


def _patched(source: Path, target: Path, name: str, *, part: str, value: bytes) -> Path:
    data = bytearray(source.read_bytes())
    start = _tensor_info_positions(source, name)[part]
    data[start : start + len(value)] = value
    target.write_bytes(bytes(data))
    return target


def _convert(capsys: pytest.CaptureFixture[str], gguf_path: Path, out_dir: Path) -> tuple[int, str]:
    status = cli.main(["convert", "gguf", str(gguf_path), str(out_dir)])
    captured = capsys.readouterr()
    return status, captured.err


def _assert_refused(
    capsys: pytest.CaptureFixture[str], gguf_path: Path, tmp_path: Path, *expected: str
) -> str:
    parent = tmp_path / "models"
    parent.mkdir(exist_ok=True)
    before = set(parent.iterdir())
    status, err = _convert(capsys, gguf_path, parent / "out")
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tokenwire convert gguf: ")
    for fragment in expected:
        assert fragment in lines[0]
    # Not the output directory, nor a scratch directory beside it.
    assert set(parent.iterdir()) == before
    return lines[0]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> SyntheticGguf:
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf", formats=MIXED_FORMATS)


def test_bad_magic(good: SyntheticGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad_magic.gguf"
    path.write_bytes(b"GGML" + good.path.read_bytes()[4:])
    _assert_refused(capsys, path, tmp_path, "bad_magic.gguf is not a GGUF file", "b'GGML'")


def test_empty_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _assert_refused(capsys, path, tmp_path, "empty.gguf is not a GGUF file")


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _assert_refused(capsys, tmp_path / "absent.gguf", tmp_path, "cannot read", "absent.gguf")


@pytest.mark.parametrize("keep", [100, 2000, 13000])
def test_truncated_header(
    keep: int, good: SyntheticGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "short.gguf"
    path.write_bytes(good.path.read_bytes()[:keep])
    _assert_refused(capsys, path, tmp_path, "short.gguf is truncated or corrupt")


def test_truncated_tensor_data(
    good: SyntheticGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = good.path.read_bytes()
    path = tmp_path / "half.gguf"
    path.write_bytes(data[: len(data) // 2])
    line = _assert_refused(capsys, path, tmp_path, "half.gguf is truncated or corrupt", "tensor ")
    assert f"the file has {len(data) // 2} bytes" in line


def test_tensor_offset_past_the_end(
    good: SyntheticGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _patched(
        good.path,
        tmp_path / "offset.gguf",
        "blk.1.ffn_down.weight",
        part="offset",
        value=np.uint64(1 << 40).tobytes(),
    )
    _assert_refused(capsys, path, tmp_path, "tensor blk.1.ffn_down.weight", "needs bytes")


def test_tensor_shape_that_outgrows_the_file(
    good: SyntheticGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _patched(
        good.path,
        tmp_path / "shape.gguf",
        "output_norm.weight",
        part="dims",
        value=np.uint64(1 << 30).tobytes(),
    )
    _assert_refused(capsys, path, tmp_path, "tensor output_norm.weight", "needs bytes")


def test_overlapping_tensors(good: SyntheticGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # blk.0.attn_norm's data moved onto the start of token_embd's.
    path = _patched(
        good.path, tmp_path / "overlap.gguf", "blk.0.attn_norm.weight", part="offset", value=bytes(8)
    )
    _assert_refused(capsys, path, tmp_path, "overlaps", "blk.0.attn_norm.weight", "token_embd.weight")


def test_unknown_tensor_type(good: SyntheticGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _patched(
        good.path, tmp_path / "type.gguf", "blk.0.attn_q.weight", part="type", value=np.uint32(250).tobytes()
    )
    _assert_refused(capsys, path, tmp_path, "tensor blk.0.attn_q.weight", "unknown GGML type 250", "Q4_K")


def test_unsupported_tensor_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "iq2.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    raw = np.zeros((4, 256 // block_elems * block_bytes), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=Q.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_refused(
        capsys, path, tmp_path, "tensor token_embd.weight has type IQ2_XXS", "not supported", "IQ4_XS"
    )


def test_unsupported_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_refused(capsys, path, tmp_path, "architecture 'gpt2' is not supported", "qwen2", "gemma3", "phi3")


def test_metadata_that_disagrees_with_a_tensor_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "lying.gguf"
    write_synthetic_gguf(path, formats=MIXED_FORMATS)
    reader = gguf.GGUFReader(path, "r+")
    # feed_forward_length halved: the FFN tensors no longer match the header.
    reader.fields["llama.feed_forward_length"].parts[-1][0] //= 2
    del reader
    _assert_refused(capsys, path, tmp_path, "tensor blk.0.ffn_gate.weight has shape", "metadata implies")


def test_a_tensor_of_another_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "qwen2_as_llama.gguf"
    write_synthetic_gguf(path, formats=MIXED_FORMATS, arch="qwen2")
    data = path.read_bytes().replace(b"qwen2", b"llama")
    path.write_bytes(data)
    _assert_refused(capsys, path, tmp_path, "tensor blk.0.attn_q.bias is not part of the llama architecture")


def test_unsupported_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bert.gguf"
    write_synthetic_gguf(path, formats=MIXED_FORMATS, tokenizer_model="bert")
    _assert_refused(capsys, path, tmp_path, "tokenizer model 'bert'")


def test_refusal_keeps_an_earlier_conversion(
    good: SyntheticGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = convert_gguf(good.path, tmp_path / "models" / "out")
    weights = (out / "model.onnx.data").read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(good.path.read_bytes()[:5000])
    status, err = _convert(capsys, broken, out)
    assert status == 2
    assert "truncated" in err
    assert (out / "model.onnx.data").read_bytes() == weights
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["out"]


def test_the_command_prints_no_traceback(good: SyntheticGguf, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(good.path.read_bytes()[:3000])
    result = subprocess.run(
        [sys.executable, "-m", "tokenwire.server.cli", "convert", "gguf", str(path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("tokenwire convert gguf: cut.gguf is truncated or corrupt")
    assert not (tmp_path / "out").exists()
