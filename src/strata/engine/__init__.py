"""The engine: the model and everything that runs it (weights, experts, K/V, generate, serve)."""
