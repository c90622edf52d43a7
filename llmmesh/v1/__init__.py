"""Generated gRPC/protobuf stubs for package llmmesh.v1 (regenerate with `make protos`)."""
