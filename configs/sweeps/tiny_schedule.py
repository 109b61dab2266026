"""Sweep: learning-rate scale x warmup of configs/tiny.py, a demonstration in minutes.

  python sweep.py --config=configs/tiny.py --sweep=configs/sweeps/tiny_schedule.py \
      --workdir=workdirs/tiny_schedule --parallel=2 \
      --config.data.manual_dir=../shared/data/multi30k

Expected (measured): 8 trials of 60 steps in 6 minutes on 2 CPU cores shared with
other jobs. The summary table and plot it wrote (the ranking and each trial's
losses) are in docs/sweeps.md.
"""

from transformer.tools import sweeps


def sweep() -> list[dict]:
  """Every combination of 4 learning-rate scales and 2 warmups."""
  return sweeps.grid({'lr_scale': [0.5, 1.0, 2.0, 4.0], 'warmup_steps': [10, 30]})
