"""A decoder-only language model of Multi30k's English captions, small enough for 2 CPU cores.

The decoder stack of `configs/default.py` with its cross-attention switched off
(`model.architecture='decoder_only'`), 4 layers of d_model=256, trained on the
English side of Multi30k: every caption of `train.en` is a document, packed
into rows of 64 tokens with segment ids (no attention across captions);
validation perplexity on `val.en`. No label smoothing: the loss is the
perplexity's log.

Command (offline, reading the corpus from a local directory):

  python train.py --config=configs/lm_default.py --workdir=workdirs/lm \
      --config.data.manual_dir=../shared/data/multi30k

then

  python eval.py --workdir=workdirs/lm                       # test_2016_flickr perplexity
  python eval.py --workdir=workdirs/lm --prompt="A man in a red shirt"
  python eval.py --workdir=workdirs/lm --prompt="Two dogs" --decoder=sample --top_p=0.9

Expected (measured, one run on a 2-core x86 CPU, 2026-12-07): 4.2M parameters;
validation perplexity 36.4 at step 300, 27.6 at 600, 24.2 at 900 and 22.75 at
1,200 (token accuracy 40.6%), test_2016_flickr perplexity 22.2; 16 min of wall
time at 1.1-1.9 steps/s, the cores shared with test runs for part of it (an
earlier run, under a load average of 5-10: 67 min, perplexity 23.1 at 1,200).
`bench/train_throughput.py --config=configs/lm_default.py` measured 0.75 steps/s
at 46% of the float32 matmul peak measured in the same run (82 GFLOP/s): at that
share of the idle machine's peak (docs/benchmarks.md) about 10 min alone
(estimated), plus compiles and evaluations. Text it generated:
docs/language_model.md.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  """Returns the language-model configuration (Multi30k English, 4-layer decoder)."""
  config = default.get_config()
  config.vocab_size = 4000  # English-only SentencePiece vocabulary.

  config.num_train_steps = 1200  # About 5.5 epochs of the 29,000 training captions.
  config.warmup_steps = 200  # Linear warmup of the inverse-sqrt schedule.
  config.label_smoothing = 0.0  # Perplexity is what a language model reports.
  config.eval_every_steps = 300  # Validation perplexity cadence (and at the end).
  config.checkpoint_every_steps = 300  # Checkpoint cadence (and at the end).
  config.eval_bleu_sentences = 0  # No translations to score.
  config.target_metric = 'eval_loss'  # Ranks sweep trials: validation loss (log perplexity).

  config.model.architecture = 'decoder_only'  # The decoder stack without cross-attention.
  config.model.num_layers = 4  # Decoder layers (d_model 256, 4 heads, d_ff 1024 as default.py).

  config.data.dataset = 'text_lines'  # SPLIT.LANG[.gz] files of one language in manual_dir.
  config.data.source_lang = ''  # Unused: a language model has no source side.
  config.data.target_lang = 'en'  # The text: train.en, val.en, test_2016_flickr.en.
  config.data.max_len = 64  # Training windows (and rows) of 64 tokens.
  config.data.max_eval_len = 256  # Rows of evaluation batches; captions are far shorter.
  config.data.tokens_per_batch = 2048  # 32 rows of 64 tokens.
  config.data.lines_per_document = 1  # Each caption is a document.
  return config
