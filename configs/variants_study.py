"""configs/default.py scaled down so that all the variant switches can be compared on 2 CPU cores.

Multi30k En->De at d_model=128, 2+2 layers, 300 steps of 2,048-token batches:
each run takes 2.5-3 minutes alone on a 2-core CPU (training, then eval.py's
greedy validation BLEU), so the study (`configs/sweeps/variants_study.py`, 9
runs, one switch at a time from the paper's model) takes about 25 minutes a seed.
Compare the variants at equal steps:

  python sweep.py --config=configs/variants_study.py \
      --sweep=configs/sweeps/variants_study.py --workdir=workdirs/variants_study \
      --config.data.manual_dir=../shared/data/multi30k

Metric: validation loss (label-smoothed) and greedy sacreBLEU of the whole
validation split at step 300. Measured (2-core CPU, 3 seeds, with the tests of
each switch against the paper's model): the table in results/variants.md. Early in
training, as here, the differences show how fast each variant learns, not where it ends.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.num_train_steps = 300
  config.warmup_steps = 100
  config.lr_scale = 1.0
  config.log_every_steps = 25
  config.eval_every_steps = 300
  config.checkpoint_every_steps = 300
  config.eval_bleu_sentences = 1014  # The whole validation split.
  config.keep_checkpoints = 1
  config.model.num_layers = 2
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.d_ff = 512
  config.data.tokens_per_batch = 2048
  return config
