"""Translation by the encoder-decoder: the model side of the decoders, jitted once per shape.

`translate` is the model side of the decoders' contract in `decoding.py`:
`_init_state` encodes the source once and builds the decoder's cache
(self-attention key/value buffers plus the cross-attention keys and values of
the encoder output); `_logits_fn` runs one decoder step. Everything is a pure
function of (params, source tokens, key), jitted once per source length
(`make_translate_fn`). `translate_lines` translates any text, one output line
per input line.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from jax.sharding import Mesh

from transformer import beam_search, decoding, inference, sharding
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.tasks.translation import data


def _init_state(params, src_tokens_BS: jax.Array, model_config: ModelConfig, max_decode_len: int):
  """Encodes the source and creates the decoding cache (index 0, cross K/V filled)."""
  model = Transformer(
    model_config.replace(deterministic=True, decode=True, max_decode_len=max_decode_len)
  )
  src_segments_BS = (src_tokens_BS != 0).astype(jnp.int32)
  encoded_BSD = model.apply(
    {'params': params}, src_tokens_BS, src_segments_BS, method=Transformer.encode
  )
  bos_B1 = jnp.full((src_tokens_BS.shape[0], 1), tokenizer_lib.BOS_ID, jnp.int32)
  _, variables = model.apply(
    {'params': params},
    encoded_BSD,
    src_segments_BS,
    bos_B1,
    method=Transformer.decode,
    mutable=['cache'],
  )
  return model, {'cache': variables['cache'], 'src_segments': src_segments_BS}


def _logits_fn(model: Transformer, params):
  """One decoder step: (tokens [N, 1], state) -> (logits [N, V], state)."""

  def step(tokens_N1, state):
    # The encoder output is only read when the cache is created; steps use the
    # cross-attention keys and values held in the cache.
    logits_N1V, variables = model.apply(
      {'params': params, 'cache': state['cache']},
      None,
      state['src_segments'],
      tokens_N1,
      method=Transformer.decode,
      mutable=['cache'],
    )
    # A translation never holds pad or bos: they are inputs only (as transformers' Marian
    # models ban pad with bad_words_ids; an imported OPUS-MT model's bos is its pad row).
    logits_NV = logits_N1V[:, 0].at[:, (tokenizer_lib.PAD_ID, tokenizer_lib.BOS_ID)].set(-jnp.inf)
    return logits_NV, {**state, 'cache': variables['cache']}

  return step


# Decoding-state leaves that are equal across the beams of a sentence (the encoder output's
# keys/values and the source segments): beam search leaves them where they are.
_BEAM_INVARIANT = ('cross_key', 'cross_value', 'src_segments')
# The self-attention caches, [N, H, K, T]: only the positions written so far move.
_SELF_ATTENTION_CACHE = ('cached_key', 'cached_value')


def _reorder_beam_state(state, beam_indices_BW: jax.Array):
  """`beam_search.reorder_beam_rows` on every leaf but the beam-invariant ones.

  The self-attention caches move by `beam_search.reorder_beam_prefix`: the positions
  written so far only (`cache_index`, the same in every layer), the same result.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  names = [[getattr(key, 'key', None) for key in path] for path, _ in flat]
  leaves = [x for _, x in flat]
  is_cache = [n[-1] in _SELF_ATTENTION_CACHE for n in names]
  written = next(x for x, n in zip(leaves, names, strict=True) if n[-1] == 'cache_index')
  moved = iter(
    beam_search.reorder_beam_prefix(
      [x for x, cache in zip(leaves, is_cache, strict=True) if cache], beam_indices_BW, written
    )
  )

  def reordered(x, name, cache):
    if cache:
      return next(moved)
    if set(name) & set(_BEAM_INVARIANT):
      return x
    return beam_search.reorder_beam_rows(x, beam_indices_BW)

  return jax.tree_util.tree_unflatten(
    treedef, [reordered(*args) for args in zip(leaves, names, is_cache, strict=True)]
  )


def translate(
  params,
  src_tokens_BS: jax.Array,
  rng: jax.Array,
  *,
  model_config: ModelConfig,
  options: inference.DecodeOptions,
  first_pass: bool = False,
) -> decoding.Decoded:
  """Best translation of each source row: tokens int32 [B, S + max_extra_len], 0-padded after EOS.

  Each row's output is limited to its own source length + `max_extra_len`
  tokens (EOS included), as in the paper. With `first_pass`, only
  `inference.first_pass_steps` steps are decoded (the rest of each row is padding) and
  `done` says which rows finished within them.
  """
  max_decode_len, max_steps = inference.decode_steps(src_tokens_BS.shape[1], options, first_pass)
  model, state = _init_state(params, src_tokens_BS, model_config, max_steps)
  src_lengths_B = jnp.sum(src_tokens_BS != 0, axis=1).astype(jnp.int32)
  # An all-PAD row (batch padding) is no sentence: one step ends it, instead of its running
  # to the length limit and holding up the loop.
  max_lengths_B = jnp.where(src_lengths_B > 0, src_lengths_B + options.max_extra_len, 1)
  return inference.run_decoder(
    _logits_fn(model, params),
    state,
    rng,
    options,
    max_decode_len,
    max_lengths_B,
    _reorder_beam_state,
    max_steps=max_steps,
  )


def make_translate_fn(
  model_config: ModelConfig,
  options: inference.DecodeOptions,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
):
  """`translate(params, src_tokens, rng) -> tokens` as a host array, jitted per source shape.

  Every decoder runs in two passes (`inference.TwoPass`): `inference.first_pass_steps` steps
  first, then all of them for the rows that need more (its shapes compiled only then).
  A row's output does not depend on its batch (sampling: each row has its own key), so
  the two passes give one pass's outputs. Greedy decoding's shorter cache made its
  compiled decode 1.13-1.18x as fast, the whole eval.py call the same within noise
  (docs/benchmarks.md). Rows are split over the mesh (`inference.jit_rows`).
  """

  decode_fn = functools.partial(translate, model_config=model_config, options=options)
  return inference.two_pass_fn(decode_fn, mesh, rules)


# `translate_lines` called again in one process (a bench's second pass, a notebook, a server)
# reuses the jitted functions of the same model and options, compiled once; without it,
# every call traced and compiled every shape again (7.3 s of a 12.2 s greedy call on
# test_2016_flickr). Params are arguments of the functions, so any parameters may be passed.
_cached_translate_fn = functools.lru_cache(maxsize=8)(make_translate_fn)


def translate_lines(
  config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  params,
  lines: Sequence[str],
  *,
  options: inference.DecodeOptions,
  batch_size: int | None = None,
  seed: int = 0,
  max_tokens: int = inference.MAX_DECODE_TOKENS,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
) -> list[str]:
  """One translation per input line; empty input lines give empty output lines.

  Decoded sorted by length, as `evaluate.evaluate_split` does. A line longer
  than `config.data.max_eval_len` tokens is truncated to fit (a warning names it).

  Args:
    config: The run's config.
    model_config: Its model.
    params: The parameters to translate with.
    lines: The source sentences.
    options: The decoder and its settings.
    batch_size: Most sentences decoded at once (default: `inference.batch_size`'s for the
      devices of `mesh`); on one CPU device, `inference.concurrent_batches` batches at once.
    seed: Of the decoder's key (sampling).
    max_tokens: Most source token slots per batch.
    mesh: The devices the rows are split over (None: one device).
    rules: `mesh`'s logical axis rules.

  Returns:
    The translations, one per line of `lines`.
  """
  tokenizer = tokenizer_lib.get_tokenizer(
    config.data, vocab_size=config.vocab_size, seed=config.seed
  )
  max_len = config.data.max_eval_len
  too_long = [
    number
    for number, line in enumerate(lines, start=1)
    if line.strip() and len(tokenizer.encode(line)) > max_len - 1
  ]
  if too_long:
    shown = ', '.join(map(str, too_long[:20])) + (
      f' and {len(too_long) - 20} more' if len(too_long) > 20 else ''
    )
    logging.warning(
      '%d input lines are longer than the model reads (config.data.max_eval_len=%d tokens, EOS '
      'included): each was truncated to fit, so its translation covers only its start. '
      'Lines: %s.',
      len(too_long),
      max_len,
      shown,
    )
  translate_fn = _cached_translate_fn(model_config, options, mesh, tuple(rules))
  if batch_size is None:
    batch_size = inference.batch_size(options, mesh)
  batches = inference.length_sorted_batches(
    data.text_batches(lines, tokenizer, batch_size, max_len),
    max_tokens=max_tokens,
    max_rows=batch_size,
    max_len=max_len,
  )
  translations, _ = inference.decode_batches(
    translate_fn,
    params,
    batches,
    tokenizer,
    jax.random.key(seed),
    concurrency=inference.concurrent_batches(mesh),
  )
  return [translations.get(i, '') for i in range(len(lines))]
