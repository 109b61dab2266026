"""The paper's big model on WMT14 English->German (Table 3, row "big").

  python train.py --config=configs/wmt14_ende_big.py --workdir=$WORKDIR

N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3, 300k steps. The paper trained for
3.5 days on 8 P100 GPUs and reports 28.4 BLEU (newstest2014, average of the last
20 checkpoints). `train.py --dry_run` reports 214.2M parameters at vocabulary 37,000.
It fits a v5e-8 TPU slice as it is, by the TPU compiler (6.63 GiB per chip of 16, bound
MFU 25%; docs/devices.md, "The paper's configs on the slices people rent"):

  python train.py --config=configs/wmt14_ende_big.py --dry_run --topology=v5e-8
"""

import ml_collections

from configs import wmt14_ende_base


def get_config() -> ml_collections.ConfigDict:
  config = wmt14_ende_base.get_config()
  config.num_train_steps = 300_000
  config.model.d_model = 1024
  config.model.num_heads = 16
  config.model.d_ff = 4096
  config.model.dropout_rate = 0.3
  return config
