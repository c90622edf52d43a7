"""The inference worker: model, paged KV cache, continuous batching, WorkerService."""
