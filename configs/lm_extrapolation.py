"""Length extrapolation: train on 64-token windows, score perplexity on 64, 128 and 256.

A smaller `configs/lm_default.py` (2 layers, d_model 128) trained on running
text: 64 consecutive Multi30k English captions joined into one document (about
930 tokens), cut into 64-token training windows. `sweep()` gives one run per
position encoding; each run is then scored on test_2016_flickr in windows of
64, 128 and 256 tokens, where positions 64-255 were never seen in training:

  python train.py --config=configs/lm_extrapolation.py --workdir=workdirs/lm_ext_rope \
      --config.data.manual_dir=../shared/data/multi30k --config.model.position=rope
  python eval.py --workdir=workdirs/lm_ext_rope --lengths=64,128,256

`python -m configs.lm_extrapolation` prints every command. `model.max_len` is 64
for every run; only learned positions depend on it (a table of 64 rows), so the
learned run cannot be scored beyond 64 and says so.

Measured (one seed each; 9-17 min of wall time per run on a shared 2-core CPU),
test perplexity in windows of 64 / 128 / 256 tokens: sinusoidal 37.8 / 48.8 /
56.6, learned 40.2 / - / -, rope 34.2 / 36.6 / 43.2, alibi 35.9 / 35.7 / 35.5.
The README's "Length extrapolation" section has the per-position breakdown.
"""

from typing import Any

import ml_collections

from configs import lm_default

EVAL_LENGTHS = (64, 128, 256)  # Window lengths scored by eval.py --lengths.


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


def sweep() -> list[dict[str, Any]]:
  """One override dict per position encoding (dotted config keys)."""
  return [{'model.position': position}
          for position in ('sinusoidal', 'learned', 'rope', 'alibi')]


def commands(overrides: dict[str, Any]) -> tuple[str, str]:
  """The train.py and eval.py command lines of one run."""
  workdir = f'workdirs/lm_ext_{overrides["model.position"]}'
  flags = ''.join(f' --config.{key}={value}' for key, value in overrides.items())
  train = (f'python train.py --config=configs/lm_extrapolation.py --workdir={workdir}'
           f' --config.data.manual_dir=../shared/data/multi30k{flags}')
  lengths = ','.join(str(length) for length in EVAL_LENGTHS)
  return train, f'python eval.py --workdir={workdir} --lengths={lengths}'


if __name__ == '__main__':
  for overrides in sweep():
    print('\n'.join(commands(overrides)))
