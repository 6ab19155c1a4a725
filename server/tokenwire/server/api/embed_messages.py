"""EmbedRequest and EmbedResponse to and from the plain embedding types: protobuf stays here."""

from __future__ import annotations

from tokenwire.server.api.embeddings import Embedded, EmbeddingInput, EmbedItem
from tokenwire.v1 import inference_service_pb2 as pb


def embedding_input(request: pb.EmbedRequest) -> EmbeddingInput:
    items: list[EmbedItem] = [
        tuple(item.token_ids.ids) if item.WhichOneof("input") == "token_ids" else item.text
        for item in request.inputs
    ]
    return EmbeddingInput(
        request.model,
        tuple(items),
        "inputs",
        request_id=request.request_id,
        dimensions=request.dimensions if request.HasField("dimensions") else None,
    )


def embed_response(embedded: Embedded) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        request_id=embedded.request_id,
        model=embedded.model,
        embeddings=[pb.Embedding(values=vector.tolist()) for vector in embedded.result.vectors],
        prompt_tokens=embedded.result.prompt_tokens,
        pooling=embedded.pooling.value,
    )
