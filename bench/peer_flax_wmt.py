"""The Flax WMT example's model trained at the same shape as `train_throughput.py`'s fixed batch.

The peer of the side-by-side step comparison (issue 14). Its model is imported from
a copy of google/flax's `examples/wmt/models.py` (nothing of it is in this
repository), e.g. from a checkout of google/flax:

  python bench/peer_flax_wmt.py --flax_wmt_dir=../flax/examples/wmt \\
      --vocab_size=8000 --d_model=256 --num_layers=3 --num_heads=4 --d_ff=1024 \\
      --batch_rows=128 --batch_len=32

The train step is the example's recipe written here: shared embeddings and softmax,
label-smoothed cross-entropy over a one-hot (0.1), Adam, one jitted update on a
fixed-length unpacked batch (random ids, every token real). Prints the median step
time and target tokens/s, to set beside `train_throughput.py --batch_rows ... --batch_len ...`.
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# First: on a CPU-only host it keeps JAX from loading libtpu and the CUDA plugin
# (transformer/__init__.py).
import transformer  # noqa: E402, F401, I001

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import flags  # noqa: E402

from transformer import errors  # noqa: E402

_DIR = flags.DEFINE_string('flax_wmt_dir', None, "Directory holding the example's models.py.")
_VOCAB = flags.DEFINE_integer('vocab_size', 8000, 'Shared vocabulary size.')
_D_MODEL = flags.DEFINE_integer('d_model', 256, 'Embedding and attention width.')
_LAYERS = flags.DEFINE_integer('num_layers', 3, 'Encoder layers, and decoder layers.')
_HEADS = flags.DEFINE_integer('num_heads', 4, 'Attention heads.')
_D_FF = flags.DEFINE_integer('d_ff', 1024, 'Feed-forward width.')
_DROPOUT = flags.DEFINE_float('dropout_rate', 0.1, 'Dropout on sub-layer outputs.')
_ATTENTION_DROPOUT = flags.DEFINE_float('attention_dropout_rate', 0.0, 'Dropout on weights.')
_ROWS = flags.DEFINE_integer('batch_rows', 128, 'Rows of the fixed-length batch.')
_LEN = flags.DEFINE_integer('batch_len', 32, 'Real tokens per row.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps (after one compile step).')


def load_models(directory: str):
  path = os.path.join(directory, 'models.py')
  if not os.path.isfile(path):
    raise errors.MissingInput(
      f"--flax_wmt_dir={directory} has no models.py: name google/flax's examples/wmt folder."
    )
  spec = importlib.util.spec_from_file_location('flax_wmt_models', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main(argv):
  del argv
  models = load_models(_DIR.value)
  cfg = models.TransformerConfig(
    vocab_size=_VOCAB.value,
    output_vocab_size=_VOCAB.value,
    share_embeddings=True,
    logits_via_embedding=True,
    emb_dim=_D_MODEL.value,
    num_heads=_HEADS.value,
    num_layers=_LAYERS.value,
    qkv_dim=_D_MODEL.value,
    mlp_dim=_D_FF.value,
    max_len=512,
    dropout_rate=_DROPOUT.value,
    attention_dropout_rate=_ATTENTION_DROPOUT.value,
  )
  model = models.Transformer(cfg)
  rng = np.random.default_rng(0)
  inputs, targets = rng.integers(3, _VOCAB.value, size=(2, _ROWS.value, _LEN.value), dtype=np.int32)
  params = jax.jit(lambda k: model.init(k, inputs[:1], targets[:1])['params'])(jax.random.key(0))
  optimizer = optax.adam(1e-4, b1=0.9, b2=0.98, eps=1e-9)
  opt_state = optimizer.init(params)

  def loss_fn(params, key):
    logits = model.apply({'params': params}, inputs, targets, rngs={'dropout': key})
    onehot = optax.smooth_labels(jax.nn.one_hot(targets, _VOCAB.value), 0.1)
    weights = (targets > 0).astype(jnp.float32)
    loss = optax.softmax_cross_entropy(logits, onehot) * weights
    return loss.sum() / weights.sum(), weights.sum()

  @jax.jit
  def step(params, opt_state, key):
    (_, tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, tokens

  key = jax.random.key(1)
  params, opt_state, tokens = step(params, opt_state, key)
  jax.block_until_ready(tokens)
  seconds = []
  for i in range(_STEPS.value):
    start = time.perf_counter()
    params, opt_state, tokens = step(params, opt_state, jax.random.fold_in(key, i))
    jax.block_until_ready(tokens)
    seconds.append(time.perf_counter() - start)
  median = float(np.median(seconds))
  print(
    f'flax wmt example: median step {median:.3f} s, target tokens/s '
    f'{float(tokens) / median:,.0f} ({_ROWS.value} x {_LEN.value}, d_model {_D_MODEL.value}, '
    f'{_LAYERS.value}+{_LAYERS.value} layers)'
  )


if __name__ == '__main__':
  flags.mark_flags_as_required(['flax_wmt_dir'])
  errors.run(main)
