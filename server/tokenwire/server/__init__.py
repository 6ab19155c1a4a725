"""tokenwire's server: gRPC API, scheduling engine, ONNX Runtime model runners."""
