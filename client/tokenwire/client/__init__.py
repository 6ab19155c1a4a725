"""tokenwire's client library: typed sync and asyncio clients for the tokenwire gRPC service.

from tokenwire.client import Client, GenerateOptions, Stopping
with Client("localhost:50051") as client:
    print(client.generate("Hello", GenerateOptions(stopping=Stopping(max_new_tokens=32))).text)
"""

from tokenwire.client.aio import AsyncClient, MultiplexedStream, collect
from tokenwire.client.channel import Tls, service_config
from tokenwire.client.errors import FieldViolation, TokenwireError
from tokenwire.client.routing import Routing
from tokenwire.client.sync import Client, SyncStream
from tokenwire.client.types import (
    ChatMessage,
    Chunk,
    Completed,
    CompletionChoice,
    Failed,
    FinishReason,
    GenerateOptions,
    Generation,
    ModelDescription,
    Priority,
    Queued,
    ResponseFormat,
    Sampling,
    Started,
    Stopping,
    StreamEvent,
    Timing,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
)

__all__ = [
    "AsyncClient",
    "ChatMessage",
    "Chunk",
    "Client",
    "Completed",
    "CompletionChoice",
    "Failed",
    "FieldViolation",
    "FinishReason",
    "GenerateOptions",
    "Generation",
    "ModelDescription",
    "MultiplexedStream",
    "Priority",
    "Queued",
    "ResponseFormat",
    "Routing",
    "Sampling",
    "Started",
    "Stopping",
    "StreamEvent",
    "SyncStream",
    "Timing",
    "Tls",
    "TokenLogprob",
    "TokenwireError",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "collect",
    "service_config",
]
