"""The OpenAI-compatible HTTP API: chat completions, completions and models on the gRPC server's
engines, in the same process and event loop. Protobuf-free: requests become RequestSpecs and go
through the gRPC edge's admission; engine events become OpenAI's JSON and server-sent events."""
