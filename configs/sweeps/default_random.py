"""Sweep: a seeded random search over the schedule and regularisation of configs/default.py.

  python sweep.py --config=configs/default.py --sweep=configs/sweeps/default_random.py \
      --workdir=workdirs/default_random --config.data.manual_dir=../shared/data/multi30k

12 trials, each as long as the default run (about an hour on 2 CPU cores; see its
docstring), ranked by best validation BLEU. The same seed gives the same trials,
so the command can be stopped and run again.
"""

from transformer.tools import sweeps


def sweep() -> list[dict]:
  """12 draws: learning-rate scale, warmup, dropout and label smoothing."""
  return sweeps.random_search(
    {
      'lr_scale': sweeps.log_uniform(0.25, 2.0),
      'warmup_steps': sweeps.choice([200, 400, 800]),
      'model.dropout_rate': sweeps.uniform(0.0, 0.3),
      'label_smoothing': sweeps.choice([0.0, 0.1]),
    },
    num_trials=12,
    seed=0,
    digits=2,
  )
