"""Multi30k En->De with a small Transformer that trains on 2 CPU cores.

The paper's base architecture (post-LN, sinusoidal positions, shared embeddings,
label smoothing 0.1, Adam 0.9/0.98/1e-9 with inverse-sqrt warmup) scaled down to
d_model=256, 3+3 layers, so that it trains on a laptop-class CPU within an hour.

Command (offline, reading the corpus from a local directory):

  python train.py --config=configs/default.py --workdir=workdirs/m30k \
      --config.data.manual_dir=../shared/data/multi30k

Expected (measured once, 2-core x86 CPU): 7.6M parameters; 1,500 steps at 0.55
steps/s, 45.7 min alone (before the 2-D matmuls of docs/benchmarks.md: 0.46
steps/s, 55 min). At step 1,500: validation loss 2.81 (label-smoothed),
perplexity 5.63, token accuracy 66.6%. On test_2016_flickr (1,000 sentences),
scored by `python eval.py --workdir=workdirs/m30k [FLAGS]`:

  checkpoint, decoder (FLAGS)             sacreBLEU  compound-split BLEU  chrF
  step 1500, beam 4, alpha 0.6 (none)     37.2       37.2                 61.4
  last 5 averaged (--checkpoint=avg:5)    37.2       37.3                 61.3
  step 1500, greedy (--decoder=greedy)    35.6       35.5                 60.4

Each BLEU equals `sacrebleu REF -i WORKDIR/eval/<file>.txt` run by hand on the
written translations. Over 3 seeds (results/recipe.md stage 8), the last checkpoint, beam 4:
test_2016_flickr 36.69 +- 0.60 sacreBLEU, 37.12 +- 0.58 lowercased; validation 36.60 +- 0.75,
36.70 +- 0.71; 49-53 min each, not alone. Published text-only Transformers reach 38-41 (tokenized
BLEU) on this test set with longer training.
"""

import ml_collections

from transformer import config_fields


def get_config() -> ml_collections.ConfigDict:
  """Returns the default configuration (Multi30k En->De, small model).

  Every field, its default and its one-line meaning are declared once, in
  transformer/config_fields.py (the table: docs/config.md); configs that start from this one
  change what they need.
  """
  return config_fields.defaults()
