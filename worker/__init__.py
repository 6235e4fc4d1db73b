"""The GPU side of one tensor-parallel rank: models, layers, attention, KV cache, sampling, the engine."""
