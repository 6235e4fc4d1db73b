"""HTTP frontend: the OpenAI-compatible API, tokenization and detokenization, routing over replicas."""
