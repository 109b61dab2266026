"""Sweep: the recipe study's last stage, each candidate at the length 60 minutes hold.

  python sweep.py --config=configs/recipe_study.py \
      --sweep=configs/sweeps/recipe_final.py --workdir=workdirs/recipe_final \
      --parallel=2 --eval --eval_flags='--split=validation' \
      --config.schedule=linear --config.model.dropout_rate=0.2 \
      --config.keep_checkpoints=40 --config.decode.beam_size=5 \
      --config.decode.alpha=1.0 --config.decode.checkpoint=avg:10 \
      --config.data.manual_dir=../shared/data/multi30k

Stage 3's best trial (configs/sweeps/recipe_full.py) decayed the rate linearly to 0. That
schedule depends on num_train_steps, so each model trains as many steps as fit 60
minutes alone on 2 CPU cores (results/recipe.md, stage 2: ~0.98 steps/s pre-LN, ~1.07 post-LN),
less a margin of ~3 minutes for compile, evaluations and noise. Each is scored the way a
recipe is: the last 10 checkpoints averaged, beam 5, length penalty 1.0 (stage 3's decoding
grid). Selection is on the validation split only.
"""


def sweep() -> list[dict]:
  """The pre-LN candidate for the best recipe; the post-LN one, paper-faithful but the decay."""
  return [
    {'model.norm': 'pre_ln', 'num_train_steps': 3200},
    {'num_train_steps': 3500},
  ]
