"""Model loading and execution: ONNX Runtime runners, format adapters, model builders."""
