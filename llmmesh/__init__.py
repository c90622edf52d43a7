"""llmmesh: the one shared package (stubs, config, telemetry, gRPC bootstrap, queue codec, hashing)."""
