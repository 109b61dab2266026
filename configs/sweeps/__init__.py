"""Sweep files: each defines `sweep()`, a list of override dicts, for `sweep.py --sweep=FILE`."""
