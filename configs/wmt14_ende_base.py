"""The paper's base model on WMT14 English->German (Table 3, row "base").

  python train.py --config=configs/wmt14_ende_base.py --workdir=$WORKDIR

N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1, eps_ls=0.1, warmup 4000, 100k steps
of ~25k source + ~25k target tokens, shared vocabulary of ~37k. The paper trained
for 12 hours on 8 P100 GPUs and reports 27.3 BLEU (newstest2014, tokenized,
compound-split, average of the last 5 checkpoints, beam 4, alpha 0.6).
`train.py --dry_run --config=configs/wmt14_ende_base.py` reports 63.1M parameters.
It fits a v5e-8 TPU slice as it is, by the TPU compiler (3.24 GiB per chip of 16, bound
MFU 14%; docs/devices.md, "The paper's configs on the slices people rent"):

  python train.py --config=configs/wmt14_ende_base.py --dry_run --topology=v5e-8
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.vocab_size = 37000
  config.num_train_steps = 100_000
  config.warmup_steps = 4000
  config.lr_scale = 1.0
  config.log_every_steps = 100
  config.eval_every_steps = 5000
  config.eval_bleu_sentences = 1000  # newstest2013 has 3,000 lines: a third, greedy.
  config.checkpoint_every_steps = 5000  # The paper averaged checkpoints 10 minutes apart.
  config.keep_checkpoints = 20
  config.model.num_layers = 6
  config.model.d_model = 512
  config.model.num_heads = 8
  config.model.d_ff = 2048
  config.model.dropout_rate = 0.1
  config.data.dataset = 'wmt14_translate/de-en'
  config.data.eval_split = 'validation'  # newstest2013.
  config.data.test_split = 'test'  # newstest2014.
  config.data.max_len = 256
  config.data.max_eval_len = 512
  # ~25k source and ~25k target tokens: 96 rows of 256, which divide over 1, 2, 3, 4, 6, 8, 12,
  # 16, 24, 32, 48 or 96 batch shards (8 GPUs, as the paper's; 4 nodes x 8 GPUs; ...).
  config.data.tokens_per_batch = 24_576
  config.data.spm_train_sentences = 10_000_000
  return config
