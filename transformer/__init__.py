"""The Transformer of "Attention Is All You Need" in JAX/Flax: the library of the entry points."""
