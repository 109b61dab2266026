"""Sweep: the recipe study's screen, one setting at a time from `configs/recipe_study.py`.

  python sweep.py --config=configs/recipe_study.py \
      --sweep=configs/sweeps/recipe_screen.py --workdir=workdirs/recipe_screen \
      --parallel=2 --eval --eval_flags='--split=validation' \
      --config.data.manual_dir=../shared/data/multi30k

Selection is on the validation split only (eval.py beam 4 and training's greedy BLEU).
As an Optuna study that prunes the trials falling behind at their validations (2 h 1 min and
234 CPU-minutes on 2 CPU cores, the same best trial as the list; docs/sweeps.md), add
`--search=optuna --pruner=median --startup_trials=2`.
"""


def sweep() -> list[dict]:
  """The base (Transformer-Tiny, post-LN), then one change at a time."""
  return [
    {},
    {'model.dropout_rate': 0.2},
    {'model.norm': 'pre_ln'},
    {'lr_scale': 3.2},  # Peak 0.01.
    {'model.d_ff': 512},
    {'vocab_size': 4000},
  ]
