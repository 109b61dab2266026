"""Multi30k En->De: the literature's text-only Transformer-Tiny recipe, with its compute.

The peer run of the recipe study (results/recipe.md stage 10): the recipe behind Wu et al.'s
(ACL 2021) 41.02 lowercased BLEU on test2016, trained as long as they trained it, to measure
whether this code reaches that score given what the literature gave its model. From the
`README-baseline.md` of the public `LividWo/Revisit-MMT` repository and the defaults of its
fairseq: post-LN Transformer-Tiny (d_model 128, 4+4 layers, 4 heads, d_ff 256), sinusoidal
positions, ReLU, shared embeddings, dropout 0.3, label smoothing 0.1, Adam (0.9, 0.98, 1e-8),
gradients clipped at norm 25, the inverse-square-root schedule to a peak of 0.005 after 2,000
warmup updates, 8,000 updates of 8,192 tokens (4,096 on each of 2 GPUs), lowercased training
text; the last 10 epoch checkpoints averaged, beam 5.

Where this run differs, and why:
- the vocabulary: 8,000 SentencePiece unigram pieces of a case-folding model, for their joint
  BPE of 10,000 merges over lowercased Moses tokens (this project reads raw text);
- the checkpoints: one every 50 updates (about 0.85 epochs of 8,192 tokens), all kept, of which
  eval.py averages the last 10; their patience of 10 epochs without a better validation loss
  is not applied: the run trains all 8,000 updates, and `eval.py --checkpoint=avg:10@STEP`
  scores the recipe stopped at any earlier multiple of 50 (the schedule does not depend on the
  length);
- the length penalty: GNMT's with alpha 1.0 (fairseq's lenpen 1.0 divides by the length).

  python train.py --config=configs/multi30k_literature.py --workdir=workdirs/m30k_literature \
      --config.data.manual_dir=../shared/data/multi30k
  python eval.py --workdir=workdirs/m30k_literature

Expected (results/recipe.md stage 10; 3 seeds, 2-core x86 CPU): 0.61-0.76 updates a second,
so about 3-3.3 hours for the 8,000. Stopped at 5,000 (1 h 57 min to 2 h 7 min,
`--config.num_train_steps=5000` trains exactly that prefix) and scored with
`--checkpoint=avg:10@5000`: validation 41.99 +- 0.43, test_2016_flickr **41.45 +- 0.18**
lowercased BLEU (`bleu_lc`; seeds 41.33, 41.36, 41.66), against the published 41.02;
validation crosses 41.0 between 2,500 and 4,000 updates, by seed.
"""

import ml_collections

from configs import recipe_study


def get_config() -> ml_collections.ConfigDict:
  """The study's base (Transformer-Tiny, post-LN, dropout 0.3) at the literature's settings."""
  config = recipe_study.get_config()
  config.num_train_steps = 8000  # fairseq's --max-update 8000.
  config.warmup_steps = 2000  # --warmup-updates 2000.
  config.peak_learning_rate = 0.005  # --lr 0.005: the inverse square root's peak.
  config.adam_eps = 1e-8  # fairseq's default --adam-eps.
  config.grad_clip_norm = 25.0  # fairseq's default --clip-norm.
  config.data.tokens_per_batch = 8192  # --max-tokens 4096 on each of 2 GPUs.
  config.data.spm_normalization = 'nmt_nfkc_cf'  # Their training text is lowercased.
  config.target_metric = 'eval_bleu_lc'  # Its translations are lowercase: so is its BLEU.
  config.checkpoint_every_steps = 50  # About 0.85 epochs of 8,192 tokens.
  config.keep_checkpoints = 160  # All of them, so that any length can be averaged and scored.
  config.decode.beam_size = 5
  config.decode.alpha = 1.0
  config.decode.checkpoint = 'avg:10'  # The last 10 (epoch) checkpoints averaged.
  return config
