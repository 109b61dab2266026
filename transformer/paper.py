"""Settings of "Attention Is All You Need" that several parts of the project default to.

Section 6.1: "We used beam search with a beam size of 4 and length penalty alpha = 0.6 ...
We set the maximum output length during inference to input length + 50". The config's
`decode` group (`config_fields`), eval.py's `inference.DecodeOptions` and the benchmarks read
them from here.
"""

BEAM_SIZE = 4  # Beams of beam search (section 6.1).
LENGTH_PENALTY_ALPHA = 0.6  # GNMT's length penalty exponent alpha (section 6.1; Wu et al., 2016).
MAX_EXTRA_LEN = 50  # The output limit: the source length + this (section 6.1).
