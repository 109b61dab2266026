"""Translation and text generation: cached decoding wired to the decoders of `decoding.py`.

The model side of the decoders' contract: `init_state` encodes the source once
and builds the decoder's cache (self-attention key/value buffers plus the
cross-attention keys and values of the encoder output); `logits_fn` runs one
decoder step. Everything is a pure function of (params, source tokens, key), jitted
once per source length.

A decoder-only language model continues prompts (`generate`) through the same
decoders: they start from BOS as in translation, and while a row is inside its
prompt the step function allows only the prompt's next token (every other logit
is -inf), so greedy decoding and sampling (any temperature, top-k, top-p) copy
the prompt into the cache one token per step, then continue it freely. Rows
with prompts of different lengths decode together.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from transformer import config as config_lib
from transformer import decoding, input_pipeline, sharding
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.model import Transformer

DECODERS = ('beam', 'greedy', 'sample')
# Default decoding batches (`length_sorted_batches`): source token slots, and most sentences.
MAX_DECODE_TOKENS = 4096
MAX_DECODE_ROWS = 256


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How to decode; the defaults are the paper's (section 6.1)."""

  decoder: str = 'beam'
  beam_size: int = 4
  alpha: float = 0.6  # GNMT length penalty exponent.
  max_extra_len: int = 50  # Output length limit: source length + this.
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def tag(self) -> str:
    """'' for the paper's settings, else a filename-safe summary such as 'greedy'.

    Results decoded with different settings get different file names, so one
    never overwrites another.
    """
    if self == DecodeOptions():
      return ''
    if self.decoder == 'greedy':
      parts = ['greedy']
    elif self.decoder == 'beam':
      parts = [f'beam{self.beam_size}', f'alpha{self.alpha:g}']
    else:
      parts = ['sample', f't{self.temperature:g}', f'k{self.top_k}', f'p{self.top_p:g}']
    if self.max_extra_len != DecodeOptions.max_extra_len:
      parts.append(f'extra{self.max_extra_len}')
    return '_'.join(parts)

  def __post_init__(self):
    if self.decoder not in DECODERS:
      raise ValueError(f'decoder={self.decoder!r} is not one of {DECODERS}.')
    config_lib.raise_if(config_lib.decode_errors(vars(self)), 'decode options')


def _init_state(params, src_tokens_BS: jax.Array, model_config: ModelConfig, max_decode_len: int):
  """Encodes the source and creates the decoding cache (index 0, cross K/V filled)."""
  model = Transformer(model_config.replace(deterministic=True, decode=True,
                                           max_decode_len=max_decode_len))
  src_segments_BS = (src_tokens_BS != 0).astype(jnp.int32)
  encoded_BSD = model.apply({'params': params}, src_tokens_BS, src_segments_BS,
                            method=Transformer.encode)
  bos_B1 = jnp.full((src_tokens_BS.shape[0], 1), tokenizer_lib.BOS_ID, jnp.int32)
  _, variables = model.apply({'params': params}, encoded_BSD, src_segments_BS, bos_B1,
                             method=Transformer.decode, mutable=['cache'])
  return model, {'cache': variables['cache'], 'src_segments': src_segments_BS}


def _logits_fn(model: Transformer, params):
  """One decoder step: (tokens [N, 1], state) -> (logits [N, V], state)."""

  def step(tokens_N1, state):
    # The encoder output is only read when the cache is created; steps use the
    # cross-attention keys and values held in the cache.
    logits_N1V, variables = model.apply(
      {'params': params, 'cache': state['cache']}, None, state['src_segments'], tokens_N1,
      method=Transformer.decode, mutable=['cache'])
    return logits_N1V[:, 0], {**state, 'cache': variables['cache']}

  return step


# Decoding-state leaves that are equal across the beams of a sentence (the encoder output's
# keys/values and the source segments): beam search leaves them where they are.
_BEAM_INVARIANT = ('cross_key', 'cross_value', 'src_segments')


def _reorder_beam_state(state, beam_indices_BK: jax.Array):
  """`decoding.reorder_beam_rows` on every leaf but the beam-invariant ones."""

  def reorder(path, x):
    if any(getattr(key, 'key', None) in _BEAM_INVARIANT for key in path):
      return x
    return decoding.reorder_beam_rows(x, beam_indices_BK)

  return jax.tree_util.tree_map_with_path(reorder, state)


def translate(params, src_tokens_BS: jax.Array, rng: jax.Array, *, model_config: ModelConfig,
              options: DecodeOptions) -> jax.Array:
  """Best translation of each source row, int32 [B, S + max_extra_len], 0-padded after EOS.

  Each row's output is limited to its own source length + `max_extra_len`
  tokens (EOS included), as in the paper.
  """
  src_len = src_tokens_BS.shape[1]
  max_decode_len = src_len + options.max_extra_len
  model, state = _init_state(params, src_tokens_BS, model_config, max_decode_len)
  src_lengths_B = jnp.sum(src_tokens_BS != 0, axis=1).astype(jnp.int32)
  # An all-PAD row (batch padding) is no sentence: one step ends it, instead of its running
  # to the length limit and holding up the loop.
  max_lengths_B = jnp.where(src_lengths_B > 0, src_lengths_B + options.max_extra_len, 1)
  return _run_decoder(_logits_fn(model, params), state, rng, options, max_decode_len,
                      max_lengths_B)


def _run_decoder(logits_fn, state, rng: jax.Array, options: DecodeOptions, max_decode_len: int,
                 max_lengths_B: jax.Array) -> jax.Array:
  """The decoder of `options` over a step function: tokens [B, max_decode_len] (the best beam)."""
  batch = max_lengths_B.shape[0]
  common = dict(max_decode_len=max_decode_len, max_lengths=max_lengths_B,
                bos_id=tokenizer_lib.BOS_ID, eos_id=tokenizer_lib.EOS_ID)
  if options.decoder == 'beam':
    tokens_BKL, _ = decoding.beam_search(
      logits_fn, state, beam_size=options.beam_size, alpha=options.alpha,
      reorder_fn=_reorder_beam_state, **common)
    return tokens_BKL[:, 0]
  if options.decoder == 'greedy':
    return decoding.greedy_decode(logits_fn, state, batch_size=batch, **common)
  return decoding.sample_decode(
    logits_fn, state, rng, batch_size=batch, temperature=options.temperature,
    top_k=options.top_k, top_p=options.top_p, **common)


def make_translate_fn(model_config: ModelConfig, options: DecodeOptions, mesh: Mesh | None = None,
                      rules: sharding.Rules = ()):
  """`translate(params, src_tokens, rng)` jitted once per source length (see `_jit_rows`)."""
  return _jit_rows(functools.partial(translate, model_config=model_config, options=options),
                   mesh, rules)


def _jit_rows(decode_fn, mesh: Mesh | None, rules: sharding.Rules):
  """`decode_fn(params, tokens_BS, rng)` jitted, its rows over the mesh's batch axes.

  Without a mesh, a plain `jax.jit` (inputs on their devices). With a mesh, the
  rows of the batch are split over the mesh's batch axes (data-parallel decoding,
  parameters as sharded by training): every process passes the same whole host
  batch, rows are padded to a multiple of the batch shards, and every process
  gets the whole result back as a host array.
  """
  if mesh is None:
    return jax.jit(decode_fn)
  rows = sharding.rows_sharding(mesh, rules)
  shards = sharding.batch_shards(dict(mesh.shape), rules)
  jitted = jax.jit(
    lambda params, tokens_BS, key_data: decode_fn(
      params, tokens_BS, jax.random.wrap_key_data(key_data)),
    out_shardings=rows)

  def sharded_decode(params, tokens_BS, rng: jax.Array) -> np.ndarray:
    tokens_BS = np.asarray(tokens_BS)
    batch = tokens_BS.shape[0]
    padded_BS = np.pad(tokens_BS, [(0, -batch % shards), (0, 0)])  # All-PAD rows.
    with sharding.activated(mesh, rules):
      tokens = jitted(params, sharding.from_host(padded_BS, rows),
                      sharding.from_host(jax.random.key_data(rng), sharding.replicated(mesh)))
    return sharding.to_host(tokens)[:batch]

  return sharded_decode


def _init_lm_state(params, prompt_tokens_BP: jax.Array, model_config: ModelConfig,
                   max_decode_len: int):
  """Creates the decoder-only model's cache and the prompt-forcing state."""
  model = Transformer(model_config.replace(deterministic=True, decode=True,
                                           max_decode_len=max_decode_len))
  bos_B1 = jnp.full((prompt_tokens_BP.shape[0], 1), tokenizer_lib.BOS_ID, jnp.int32)
  _, variables = model.apply({'params': params}, None, None, bos_B1,
                             method=Transformer.decode, mutable=['cache'])
  state = {
    'cache': variables['cache'],
    'prompt': prompt_tokens_BP,
    'prompt_lengths': jnp.sum(prompt_tokens_BP != 0, axis=1).astype(jnp.int32),
    'step': jnp.array(0, jnp.int32),  # Shared scalar: the output position being chosen.
  }
  return model, state


def _lm_logits_fn(model: Transformer, params):
  """One step of the decoder-only model; inside its prompt a row can only copy the prompt.

  Never chooses PAD or BOS: they are not tokens of a document.
  """

  def step(tokens_N1, state):
    logits_N1V, variables = model.apply(
      {'params': params, 'cache': state['cache']}, None, None, tokens_N1,
      method=Transformer.decode, mutable=['cache'])
    logits_NV = logits_N1V[:, 0]
    prompt_NP, position = state['prompt'], state['step']
    forced_N = jax.lax.dynamic_index_in_dim(
      prompt_NP, jnp.minimum(position, prompt_NP.shape[1] - 1), axis=1, keepdims=False)
    only_forced_NV = jnp.where(jnp.arange(logits_NV.shape[-1]) == forced_N[:, None], 0.0,
                               decoding.NEG_INF)
    in_prompt_N1 = (position < state['prompt_lengths'])[:, None]
    logits_NV = jnp.where(in_prompt_N1, only_forced_NV, logits_NV)
    # PAD and BOS never occur inside a document (they are never training targets).
    vocab_V = jnp.arange(logits_NV.shape[-1])
    logits_NV = jnp.where((vocab_V == tokenizer_lib.PAD_ID) | (vocab_V == tokenizer_lib.BOS_ID),
                          decoding.NEG_INF, logits_NV)
    return logits_NV, {**state, 'cache': variables['cache'], 'step': position + 1}

  return step


def generate(params, prompt_tokens_BP: jax.Array, rng: jax.Array, *, model_config: ModelConfig,
             options: DecodeOptions) -> jax.Array:
  """Each prompt followed by its continuation, int32 [B, P + max_extra_len], 0-padded after EOS.

  `prompt_tokens_BP`: pieces without BOS or EOS, 0-padded on the right (an
  all-zero row is an empty prompt). Row b holds its prompt in its first P_b
  positions, then at most `max_extra_len` new tokens (EOS included): the
  continuation ends at EOS, the end of the document. Greedy or sampling only.
  """
  if options.decoder == 'beam':
    raise ValueError("Generation decodes greedily or by sampling; decoder='beam' is for "
                     'translation.')
  max_decode_len = prompt_tokens_BP.shape[1] + options.max_extra_len
  model, state = _init_lm_state(params, prompt_tokens_BP, model_config, max_decode_len)
  max_lengths_B = state['prompt_lengths'] + options.max_extra_len
  return _run_decoder(_lm_logits_fn(model, params), state, rng, options, max_decode_len,
                      max_lengths_B)


def make_generate_fn(model_config: ModelConfig, options: DecodeOptions, mesh: Mesh | None = None,
                     rules: sharding.Rules = ()):
  """`generate(params, prompt_tokens, rng)` jitted once per prompt width (see `_jit_rows`)."""
  return _jit_rows(functools.partial(generate, model_config=model_config, options=options),
                   mesh, rules)


def length_sorted_batches(
  batches: Iterable[dict[str, np.ndarray]], *, max_tokens: int, max_rows: int, max_len: int,
  input_key: str = 'src_tokens',
) -> list[dict[str, np.ndarray]]:
  """Decoding batches regrouped by input length, so that a batch's rows end together.

  Takes the valid rows of `batches` (as `input_pipeline.translation_batches` or
  `text_batches` make them: `input_key`, `index`, `valid`), sorts them longest
  first (equal lengths keep their order) and cuts them into batches of width
  `input_pipeline.bucket_length(longest row, max_len)` holding the largest power of
  two of rows, at most `max_rows`, whose width * rows is at most `max_tokens` (at
  least one row); the last batch holds the next power of two of the rows left. So
  few shapes occur (one per width, and the last batch's). `index`
  travels with each row: `decode_batches` puts each output back in input order.
  Each row's output does not depend on the batch it is decoded in.
  """
  if max_tokens < 1 or max_rows < 1:
    raise ValueError(f'max_tokens={max_tokens} and max_rows={max_rows} must be positive.')
  rows, indices = [], []
  for batch in batches:
    for tokens, index, valid in zip(batch[input_key], batch['index'], batch['valid'],
                                    strict=True):
      if valid:
        rows.append(tokens[:np.count_nonzero(tokens)] if tokens.any() else tokens[:0])
        indices.append(int(index))
  order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
  out, start = [], 0
  while start < len(order):
    width = input_pipeline.bucket_length(max(len(rows[order[start]]), 1), max_len)
    fit = 1 << max(0, (min(max_rows, max_tokens // width)).bit_length() - 1)
    remaining = len(order) - start
    count = min(fit, remaining)
    size = fit if remaining >= fit else 1 << (count - 1).bit_length()
    tokens_BS = np.zeros((size, width), np.int32)
    index_B = np.full((size,), -1, np.int32)
    for row, i in enumerate(order[start:start + count]):
      tokens_BS[row, :len(rows[i])] = rows[i]
      index_B[row] = indices[i]
    out.append({input_key: tokens_BS, 'index': index_B, 'valid': np.arange(size) < count})
    start += count
  return out


def decode_batches(
  translate_fn, params, batches: Iterable[dict[str, np.ndarray]],
  tokenizer: tokenizer_lib.Tokenizer, rng: jax.Array, max_sentences: int | None = None,
  input_key: str = 'src_tokens',
) -> tuple[dict[int, str], dict[str, float]]:
  """Detokenized translations keyed by input index, and decode-speed figures.

  With `max_sentences`, stops after the batch that reaches that many sentences.
  `translate_fn` may be a `make_generate_fn` function with `input_key='prompt_tokens'`.
  """
  translations: dict[int, str] = {}
  num_tokens = 0
  start = time.perf_counter()
  for i, batch in enumerate(batches):
    tokens = np.asarray(translate_fn(params, batch[input_key], jax.random.fold_in(rng, i)))
    for index, valid, row in zip(batch['index'], batch['valid'], tokens, strict=True):
      if valid:
        translations[int(index)] = tokenizer.decode(row.tolist())
        num_tokens += int(np.count_nonzero(row))
    if max_sentences is not None and len(translations) >= max_sentences:
      break
  seconds = time.perf_counter() - start
  speed = {
    'decode_seconds': seconds,
    'sentences_per_sec': len(translations) / max(seconds, 1e-9),
    'tokens_per_sec': num_tokens / max(seconds, 1e-9),
  }
  return translations, speed
