"""Model runtime: ONNX Runtime sessions, runners, the loader and warm-up."""
