"""A model and run small enough for smoke tests: finishes in well under a minute on 2 CPU cores.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny \
      --config.data.manual_dir=../shared/data/multi30k

Expected: 38k parameters; the training loss falls from about 6 to under 5 in 60 steps; nothing
about the translation quality is meaningful at this size.
"""

import ml_collections

from configs import default


def shrink(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Sizes the model, vocabulary and batches of `config` for smoke tests (in place)."""
  config.vocab_size = 512
  config.lr_scale = 1.0
  config.log_every_steps = 10
  config.model.num_layers = 1
  config.model.d_model = 32
  config.model.num_heads = 2
  config.model.d_ff = 64
  config.model.max_len = 128
  config.data.max_len = 32
  config.data.max_eval_len = 64
  config.data.tokens_per_batch = 512
  config.data.spm_train_sentences = 20_000
  return config


def get_config() -> ml_collections.ConfigDict:
  config = shrink(default.get_config())
  config.num_train_steps = 60
  config.warmup_steps = 20
  config.eval_every_steps = 30
  config.checkpoint_every_steps = 30
  config.eval_bleu_sentences = 32
  config.keep_checkpoints = 3
  config.target_metric = 'eval_loss'  # BLEU means little at this size.
  return config
