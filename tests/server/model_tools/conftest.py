"""Fixtures for the model builders and the GGUF converter: tiny models, synthetic and real GGUFs.

Tests marked `llamacpp` build llama.cpp and a transformers venv (scripts/llamacpp-tools, cached
outside the repository, about 20 minutes the first time) and are skipped unless asked for with
`pytest -m llamacpp` (`scripts/test -m llamacpp`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from tests.server.model_tools.llama_reference import ReferenceModel, reference_from_weights
from tests.server.model_tools.synthetic_gguf import MIXED_FORMATS, SyntheticGguf, write_synthetic_gguf
from tokenwire.server.model_tools.tiny_llama import create_tiny_llama, tiny_llama_config, tiny_llama_weights

HERE = Path(__file__).parent
PASSAGE_PATH = HERE / "data" / "perplexity_passage.txt"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_reference() -> ReferenceModel:
    config = tiny_llama_config()
    return reference_from_weights(
        tiny_llama_weights(config, seed=0),
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        theta=config.rope_theta,
        eps=config.rms_norm_eps,
    )


@pytest.fixture(scope="session")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> SyntheticGguf:
    """Every repackable format plus float16 and a float fallback; output tied to a Q8_0 embedding."""
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", formats=MIXED_FORMATS)


@pytest.fixture(scope="session")
def q4_1_gguf(tmp_path_factory: pytest.TempPathFactory) -> SyntheticGguf:
    """All matrices Q4_1 (offsets everywhere, fused projections), including the embedding; Q6_K head."""
    formats = {key: (Q.Q4_1, Q.Q4_1) for key in MIXED_FORMATS}
    return write_synthetic_gguf(
        tmp_path_factory.mktemp("gguf") / "q4_1.gguf", formats=formats, embedding=Q.Q4_1, head=Q.Q6_K, seed=1
    )


@pytest.fixture(scope="session")
def passage() -> str:
    return PASSAGE_PATH.read_text()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expression = str(config.getoption("markexpr", default="") or "")
    if "llamacpp" in expression and "not llamacpp" not in expression:
        return
    skip = pytest.mark.skip(reason="builds llama.cpp: run with `pytest -m llamacpp`")
    for item in items:
        if item.get_closest_marker("llamacpp") is not None:
            item.add_marker(skip)
