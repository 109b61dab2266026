"""Tooling around the library: sweeps and their summaries, significance tests, attention plots.

Nothing in the library (`transformer/`) imports these; the entry points
(`sweep.py`, `compare.py`, `eval.py --attention_plot`) and the sweep files in
configs/sweeps/ do.
"""
