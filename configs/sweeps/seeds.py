"""Sweep: the config as it is, one trial; with `--seeds=N`, N training runs of it.

  python sweep.py --config=configs/multi30k_paper.py --sweep=configs/sweeps/seeds.py \
      --workdir=workdirs/paper_seeds --seeds=3 --parallel=2 --eval \
      --config.data.manual_dir=../shared/data/multi30k

How much a recipe's score varies between training runs (results/recipe.md measures each
recipe and configs/default.py this way; compare.py tests them against each other).
"""


def sweep() -> list[dict]:
  """No override: the base config itself."""
  return [{}]
