"""The HTTP edge: the OpenAI-compatible app, its request and response models, errors, metrics,
connection limits and draining."""
