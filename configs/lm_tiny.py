"""A language model small enough for smoke tests: trains for 40 steps in seconds on 2 CPU cores.

  python train.py --config=configs/lm_tiny.py --workdir=/tmp/lm_tiny \
      --config.data.manual_dir=../shared/data/multi30k

Expected (measured): 25k parameters; 25 s on 2 CPU cores, compiles included; the training loss
(logged every 10 steps) falls from 5.7 to 4.6 and validation perplexity is
about 97 at step 40. The generated text is not meaningful at this size.
"""

import ml_collections

from configs import lm_default, tiny


def get_config() -> ml_collections.ConfigDict:
  config = tiny.shrink(lm_default.get_config())
  config.num_train_steps = 40
  config.warmup_steps = 10
  config.eval_every_steps = 20
  config.checkpoint_every_steps = 20
  config.keep_checkpoints = 2
  return config
