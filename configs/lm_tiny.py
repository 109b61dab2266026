"""A language model small enough for smoke tests: trains for 40 steps in seconds on 2 CPU cores.

  python train.py --config=configs/lm_tiny.py --workdir=/tmp/lm_tiny \
      --config.data.manual_dir=../shared/data/multi30k

Expected (measured): 25 s on 2 CPU cores, compiles included; the training loss
(logged every 10 steps) falls from 5.7 to 4.6 and validation perplexity is
about 97 at step 40. The generated text is not meaningful at this size.
"""

import ml_collections

from configs import lm_default


def get_config() -> ml_collections.ConfigDict:
  config = lm_default.get_config()
  config.vocab_size = 512
  config.num_train_steps = 40
  config.warmup_steps = 10
  config.lr_scale = 1.0
  config.log_every_steps = 10
  config.eval_every_steps = 20
  config.checkpoint_every_steps = 20
  config.keep_checkpoints = 2
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
