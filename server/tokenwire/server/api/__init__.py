"""The gRPC edge: the only place that knows about protobuf."""
