"""The paper's big model on WMT14 English->French (section 6.1).

  python train.py --config=configs/wmt14_enfr_big.py --workdir=$WORKDIR

As the En-De big model, with P_drop=0.1 (not 0.3) and a shared 32,000-piece
vocabulary; the paper reports 41.8 BLEU (newstest2014) after 3.5 days on 8 P100s.
`train.py --dry_run` reports 209.1M parameters. It fits a v5e-8 TPU slice as it is, by the
TPU compiler (6.52 GiB per chip of 16, bound MFU 25%; docs/devices.md, "The paper's configs
on the slices people rent"):

  python train.py --config=configs/wmt14_enfr_big.py --dry_run --topology=v5e-8
"""

import ml_collections

from configs import wmt14_ende_big


def get_config() -> ml_collections.ConfigDict:
  config = wmt14_ende_big.get_config()
  config.vocab_size = 32000
  config.model.dropout_rate = 0.1
  config.data.dataset = 'wmt14_translate/fr-en'
  config.data.source_lang = 'en'
  config.data.target_lang = 'fr'
  return config
