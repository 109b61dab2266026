"""The Transformer of "Attention Is All You Need" in JAX/Flax: the library of the entry points."""

import os

# The repository root: where train.py, eval.py and sweep.py live, and the code git tracks.
CODE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
