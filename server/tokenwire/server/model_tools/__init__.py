"""Offline model tooling, never on the serving path: pulling the default model, converting GGUF
to ONNX, and building the project's tiny models. The runtime that serves models is `models/`."""
