"""Generated protobuf and gRPC code for tokenwire.v1. Do not edit."""
