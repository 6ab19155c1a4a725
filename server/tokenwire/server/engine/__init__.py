"""The engine: validation, the bounded queue, continuous batching in its own thread."""
