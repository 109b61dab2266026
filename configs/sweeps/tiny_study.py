"""Optuna study: learning-rate scale and warmup of configs/tiny.py, drawn by TPE, pruned.

  python sweep.py --config=configs/tiny.py --sweep=configs/sweeps/tiny_study.py \
      --workdir=workdirs/tiny_study --num_trials=12 --startup_trials=3 --parallel=2 \
      --config.data.manual_dir=../shared/data/multi30k

Expected (measured): 12 trials in 3 min 45 s on 2 CPU cores shared with other jobs, 4 trained
to step 60 and 8 pruned at step 30 (the median pruner's one decision before the last
evaluation); the best is configs/tiny.py's own values, the enqueued first trial, at validation
loss 4.90. TPE draws its first 10 trials at random, so 12 are a random search: the grid of
tiny_schedule.py finds 4.87 (warmup_steps=30). The table is in docs/sweeps.md.
"""

from transformer.tools import sweeps


def space() -> dict:
  """Learning-rate scale and warmup, searched."""
  return {'lr_scale': sweeps.log_uniform(0.25, 8.0), 'warmup_steps': sweeps.int_uniform(5, 40)}


def sweep() -> list[dict]:
  """The first trial: configs/tiny.py's own values."""
  return [{'lr_scale': 1.0, 'warmup_steps': 20}]
