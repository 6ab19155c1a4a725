"""Authentication and transport security of the gRPC port."""
