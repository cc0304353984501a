"""Numerical primitives shared by the attention pipelines and the model (below both)."""
