"""Length extrapolation: train on 64-token windows, score perplexity on 64, 128 and 256.

A smaller `configs/lm_default.py` (2 layers, d_model 128) trained on running
text: 64 consecutive Multi30k English captions joined into one document (about
930 tokens), cut into 64-token training windows. The sweep
`configs/sweeps/lm_extrapolation.py` trains one model per position encoding and
scores each on test_2016_flickr in windows of 64, 128 and 256 tokens, where
positions 64-255 were never seen in training:

  python sweep.py --config=configs/lm_extrapolation.py \
      --sweep=configs/sweeps/lm_extrapolation.py --workdir=workdirs/lm_ext \
      --config.data.manual_dir=../shared/data/multi30k --eval --eval_flags=--lengths=64,128,256

(one trial is `python train.py --config=configs/lm_extrapolation.py
--workdir=... --config.model.position=rope`, then `python eval.py --workdir=...
--lengths=64,128,256`). `model.max_len` is 64 for every run; only learned
positions depend on it (a table of 64 rows), so the learned run cannot be
scored beyond 64 and says so.

Measured (one seed each): 9-17 min of wall time per run on a shared 2-core CPU;
the test perplexity of each position encoding per window length and position
band is the table in results/lm_extrapolation.md.
"""

import ml_collections

from configs import lm_default


def get_config() -> ml_collections.ConfigDict:
  """lm_default, smaller and on long documents, trained on 64-token windows."""
  config = lm_default.get_config()
  config.num_train_steps = 600  # About 3 epochs of the English training text.
  config.warmup_steps = 100  # Linear warmup of the inverse-sqrt schedule.
  config.lr_scale = 0.5  # Peak learning rate 0.5 * 128^-0.5 * 100^-0.5 = 4.4e-3.
  config.eval_every_steps = 300  # Validation perplexity (64-token windows) cadence.
  config.checkpoint_every_steps = 300  # Checkpoint cadence (and at the end).
  config.model.num_layers = 2  # Decoder layers.
  config.model.d_model = 128  # Width; 4 heads of 32.
  config.model.d_ff = 512  # FFN inner width.
  config.model.max_len = 64  # = the training length: learned positions have 64 rows.
  config.data.max_len = 64  # Training windows of 64 tokens.
  config.data.max_eval_len = 64  # Validation during training at the training length.
  config.data.lines_per_document = 64  # Running text: 64 captions per document.
  return config
