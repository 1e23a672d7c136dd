"""The OpenAI-compatible API server over the engine."""
