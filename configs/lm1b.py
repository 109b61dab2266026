"""A decoder-only language model on the One Billion Word benchmark (TFDS `lm1b`), for accelerators.

  python train.py --config=configs/lm1b.py --workdir=$WORKDIR

The sizes of the Flax lm1b example (6 layers, d_model=512, h=8, d_ff=2048,
rows of 128 tokens) on this project's decoder stack without cross-attention:
`train.py --dry_run --config=configs/lm1b.py` reports 35.3M parameters. Each
lm1b sentence is a document, packed with segment ids into the rows. The first
run downloads the release from statmt.org (1.7 GB; or set
`--config.data.manual_dir` to a directory holding it), prepares ~30M training
sentences as array_record and trains a 32k SentencePiece vocabulary on 10M of
them. Not yet run: no accelerator was available when it was written, so there
is no measured time or perplexity to quote. It fits a v5e-8 TPU slice as it is, by the TPU
compiler (1.92 GiB per chip of 16, bound MFU 19%; docs/devices.md, "The paper's configs on
the slices people rent"):

  python train.py --config=configs/lm1b.py --dry_run --topology=v5e-8
"""

import ml_collections

from configs import lm_default


def get_config() -> ml_collections.ConfigDict:
  config = lm_default.get_config()
  config.vocab_size = 32_000  # SentencePiece vocabulary trained on lm1b's training sentences.
  config.num_train_steps = 100_000  # 3.3B tokens: about 3 epochs of lm1b's training text.
  config.warmup_steps = 4000  # As the paper's translation schedule.
  config.lr_scale = 1.0  # Peak learning rate 512^-0.5 * 4000^-0.5 = 7e-4.
  config.log_every_steps = 100  # Console/metrics cadence.
  config.eval_every_steps = 5000  # Perplexity of the held-out split.
  config.checkpoint_every_steps = 5000  # Checkpoint cadence.
  config.keep_checkpoints = 10  # For averaging the last few.
  config.model.num_layers = 6  # Decoder layers.
  config.model.d_model = 512  # Width.
  config.model.num_heads = 8  # Heads of 64.
  config.model.d_ff = 2048  # FFN inner width.
  config.model.max_len = 512  # Covers the evaluation rows.
  config.data.dataset = 'lm1b'  # The TFDS catalog builder (see transformer/datasets/lm1b.py).
  config.data.eval_split = 'test'  # lm1b has train and test (the held-out set) only.
  config.data.test_split = 'test'  # eval.py's default split.
  config.data.max_len = 128  # Training rows of 128 tokens; sentences average ~30.
  config.data.max_eval_len = 512  # Evaluation rows (sentences never need more than one window).
  config.data.tokens_per_batch = 32_768  # 256 rows of 128 tokens.
  config.data.spm_train_sentences = 10_000_000  # Sentences sampled for the vocabulary.
  return config
