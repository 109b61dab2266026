"""Multi30k En->De: the base of the recipe study (results/recipe.md), Transformer-Tiny sized.

The screening runs of the study override this config one setting at a time
(`configs/sweeps/recipe_screen.py`); its two candidate recipes are
`configs/multi30k_paper.py` and `configs/multi30k_best.py`. The size is the text-only
"Transformer-Tiny" of Wu et al. (ACL 2021): d_model=128, 4+4 layers, 4 heads, d_ff=256,
shared embeddings, dropout 0.3, peak learning rate 0.005.

  python sweep.py --config=configs/recipe_study.py \
      --sweep=configs/sweeps/recipe_screen.py --workdir=workdirs/recipe_screen \
      --eval --eval_flags='--split=validation' \
      --config.data.manual_dir=../shared/data/multi30k

Metric: beam-4 sacreBLEU of the validation split (eval.py), never the test split.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.num_train_steps = 2000  # Screening length: about 20 epochs at 4,096 tokens a batch.
  config.warmup_steps = 800
  # Peak 0.005 = lr_scale * 128^-0.5 * 800^-0.5.
  config.lr_scale = 1.6
  config.eval_every_steps = 500
  config.eval_bleu_sentences = 1014  # The whole validation split, greedy.
  config.checkpoint_every_steps = 100
  config.keep_checkpoints = 10
  config.model.num_layers = 4
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.d_ff = 256
  config.model.dropout_rate = 0.3
  return config
