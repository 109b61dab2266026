"""Sweep: one language model per position encoding, for the length-extrapolation study.

  python sweep.py --config=configs/lm_extrapolation.py \
      --sweep=configs/sweeps/lm_extrapolation.py --workdir=workdirs/lm_ext \
      --config.data.manual_dir=../shared/data/multi30k --eval --eval_flags=--lengths=64,128,256

4 trials, 56 min in all on a shared 2-core CPU, evaluations included (a run's
time is in configs/lm_extrapolation.py); each trial's eval/*-extrapolation.json
holds its perplexity in windows of 64, 128 and 256 tokens (the table is in
results/lm_extrapolation.md).
"""


def sweep() -> list[dict]:
  """The base (sinusoidal, the paper's), then learned, rotary and ALiBi positions."""
  return [
    {},
    {'model.position': 'learned'},
    {'model.position': 'rope'},
    {'model.position': 'alibi'},
  ]
