"""Conversion of Llama-family GGUF files into ONNX Runtime GenAI-format model directories."""

from tokenwire.server.model_tools.convert.converter import (
    ProgressCallback,
    conversion_is_current,
    convert_gguf,
)
from tokenwire.server.model_tools.convert.errors import (
    ConversionError,
    CorruptGgufError,
    UnsupportedModelError,
)
from tokenwire.server.model_tools.convert.gguf_source import GgufModel, read_gguf
from tokenwire.server.model_tools.convert.llama_graph import GraphOptions, build_llama_graph
from tokenwire.server.model_tools.convert.llama_model import LlamaConfig, LlamaLayerWeights, LlamaWeights

__all__ = [
    "ConversionError",
    "CorruptGgufError",
    "GgufModel",
    "GraphOptions",
    "LlamaConfig",
    "LlamaLayerWeights",
    "LlamaWeights",
    "ProgressCallback",
    "UnsupportedModelError",
    "build_llama_graph",
    "conversion_is_current",
    "convert_gguf",
    "read_gguf",
]
