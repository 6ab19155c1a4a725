"""Registration of InferenceService with request decoding that cannot crash a call.

Unlike the generated registration, requests are decoded with `tolerant`, so bytes that are not
a valid message reach the servicer as an `UndecodableRequest` and get INVALID_ARGUMENT instead of
gRPC's UNKNOWN.
"""

from __future__ import annotations

import grpc

from tokenwire.server.api.decoding import tolerant
from tokenwire.server.api.servicer import InferenceServicer
from tokenwire.v1 import inference_service_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


def add_inference_service(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate,
            request_deserializer=tolerant(
                pb.GenerateRequest.FromString, "GenerateRequest", pb.GenerateRequest.DESCRIPTOR
            ),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "StreamGenerate": grpc.stream_stream_rpc_method_handler(
            servicer.StreamGenerate,
            request_deserializer=tolerant(
                pb.StreamGenerateRequest.FromString,
                "StreamGenerateRequest",
                pb.StreamGenerateRequest.DESCRIPTOR,
                within="generate",
            ),
            response_serializer=pb.StreamGenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,
            request_deserializer=tolerant(
                pb.GenerateRequest.FromString, "GenerateRequest", pb.GenerateRequest.DESCRIPTOR
            ),
            response_serializer=pb.StreamGenerateResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=tolerant(pb.ListModelsRequest.FromString, "ListModelsRequest"),
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
        "Embed": grpc.unary_unary_rpc_method_handler(
            servicer.Embed,
            request_deserializer=tolerant(
                pb.EmbedRequest.FromString, "EmbedRequest", pb.EmbedRequest.DESCRIPTOR
            ),
            response_serializer=pb.EmbedResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
