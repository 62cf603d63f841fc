"""storch: automatic differentiation of stochastic computation graphs (core being written)."""
