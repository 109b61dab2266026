"""Decoding shared by the tasks: options, decoder loop, jit over the mesh, batches -> text.

`length_sorted_batches` groups inputs by length and `decode_batches` turns the
outputs back into text in input order. `batch_size` and `concurrent_batches` choose
the batches by the devices: large ones on an accelerator; on a CPU, small ones decoded
side by side, two per core.
Each task supplies the model side (`tasks.translation.decode.translate`,
`tasks.language_model.generate.generate`): a step function `logits_fn(tokens, state)` and
its initial state; `run_decoder` runs the decoder of `DecodeOptions` (beam
search, greedy, sampling; `decoding.py`) over it, `jit_rows` jits it once
per input width with its rows split over the mesh, and `TwoPass` decodes in a
short first pass and again, in full, the few rows that need more steps.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from transformer import beam_search, decoding, input_pipeline, paper, sharding
from transformer import config as config_lib
from transformer import tokenizer as tokenizer_lib
from transformer.errors import InvalidInput

DECODERS = ('beam', 'greedy', 'sample')
# Default decoding batches (`length_sorted_batches`): source token slots, and most sentences.
MAX_DECODE_TOKENS = 4096
MAX_DECODE_ROWS = 256
# On one CPU device, most hypotheses (sentences x beams) per decoding batch (`batch_size`). A
# decoding step there runs mostly on one core and costs more per row in a large batch (its
# caches leave the CPU's caches; its rows step until the batch's slowest sentence is done):
# on a 2-core x86 host, beam 5 decoded 2.5x as many sentences per second in batches of 4
# sentences, two at once, as in batches of 256 (docs/benchmarks.md, "Decoding on a CPU").
CPU_DECODE_HYPOTHESES = 32


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How to decode; the defaults are the paper's (section 6.1)."""

  decoder: str = 'beam'
  beam_size: int = paper.BEAM_SIZE
  alpha: float = paper.LENGTH_PENALTY_ALPHA  # GNMT length penalty exponent.
  max_extra_len: int = paper.MAX_EXTRA_LEN  # Output length limit: source length + this.
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

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, decoder: str, **flags) -> DecodeOptions:
    """`decoder` with the run's `config.decode` settings, each overridden by `flags` given."""
    settings = {k: config.decode[k] for k in ('beam_size', 'alpha', 'max_extra_len')}
    return cls(decoder=decoder, **{**settings, **flags})

  def __post_init__(self):
    if self.decoder not in DECODERS:
      raise InvalidInput(f'decoder={self.decoder!r} is not one of {DECODERS}.')
    config_lib.raise_if(config_lib.decode_errors(vars(self)), 'decode options')


def _single_cpu_device(mesh: Mesh | None) -> bool:
  """Whether the decoder runs on one CPU device (`mesh`'s, or the default device's)."""
  devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
  return len(devices) == 1 and devices[0].platform == 'cpu' and jax.process_count() == 1


def batch_size(options: DecodeOptions, mesh: Mesh | None) -> int:
  """The default of most sentences per decoding batch for the devices that decode.

  `MAX_DECODE_ROWS` on accelerators and meshes of several devices; on one CPU device,
  `CPU_DECODE_HYPOTHESES` hypotheses: that many sentences over the beam size (at least 1).
  A sentence's output does not depend on its batch (beam search and greedy decoding).
  """
  if not _single_cpu_device(mesh):
    return MAX_DECODE_ROWS
  hypotheses = options.beam_size if options.decoder == 'beam' else 1
  return max(1, CPU_DECODE_HYPOTHESES // hypotheses)


def concurrent_batches(mesh: Mesh | None) -> int:
  """Decoding batches run at once (`decode_batches`): two per core on one CPU device, else 1.

  A CPU runs each decoding step mostly on one core, so that batches decoded side by
  side use the others; two per core, so that a core has a batch to run while the
  other waits between its operations (on 2 cores, 4 batches at once decoded beam
  search 1.17-1.23x and greedy 1.05-1.14x as fast as 2, docs/benchmarks.md).
  Elsewhere one at a time: an accelerator runs one program at a time, and the programs
  of a mesh of several devices (or processes) must start in the same order on each.
  """
  if not _single_cpu_device(mesh):
    return 1
  if hasattr(os, 'sched_getaffinity'):  # The cores this process may run on (Linux).
    return 2 * len(os.sched_getaffinity(0))
  return 2 * (os.cpu_count() or 1)


def run_decoder(
  logits_fn,
  state,
  rng: jax.Array,
  options: DecodeOptions,
  max_decode_len: int,
  max_lengths_B: jax.Array,
  reorder_fn: beam_search.ReorderFn | None = None,
  max_steps: int | None = None,
) -> decoding.Decoded:
  """The decoder of `options` over a step function: tokens [B, max_decode_len] (the best beam).

  `reorder_fn` reorders the step function's state along the beams (beam search;
  default: every leaf, `beam_search.reorder_beam_rows`). `max_steps` (default
  `max_decode_len`): see `decoding`; the positions after them are padding, and `done`
  says which rows finished within them.
  """
  decoded = _decode(
    logits_fn, state, rng, options, max_decode_len, max_lengths_B, reorder_fn, max_steps
  )
  padding = max_decode_len - decoded.tokens.shape[1]
  return decoded._replace(tokens=jnp.pad(decoded.tokens, [(0, 0), (0, padding)]))


def _decode(logits_fn, state, rng, options, max_decode_len, max_lengths_B, reorder_fn, max_steps):
  """`run_decoder`'s decoding: tokens [B, max_steps]."""
  batch = max_lengths_B.shape[0]
  common = dict(
    max_decode_len=max_decode_len,
    max_lengths=max_lengths_B,
    bos_id=tokenizer_lib.BOS_ID,
    eos_id=tokenizer_lib.EOS_ID,
    max_steps=max_steps,
  )
  if options.decoder == 'beam':
    beams = beam_search.beam_search(
      logits_fn,
      state,
      beam_size=options.beam_size,
      alpha=options.alpha,
      reorder_fn=reorder_fn,
      num_results=1,  # Only the best is read: the search stops once it is final.
      **common,
    )
    return beams._replace(tokens=beams.tokens[:, 0], scores=beams.scores[:, 0])
  if options.decoder == 'greedy':
    return decoding.greedy_decode(logits_fn, state, batch_size=batch, **common)
  return decoding.sample_decode(
    logits_fn,
    state,
    rng,
    batch_size=batch,
    temperature=options.temperature,
    top_k=options.top_k,
    top_p=options.top_p,
    **common,
  )


def jit_rows(decode_fn, mesh: Mesh | None, rules: sharding.Rules):
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
      params, tokens_BS, jax.random.wrap_key_data(key_data)
    ),
    out_shardings=rows,
  )

  def sharded_decode(params, tokens_BS, rng: jax.Array):
    tokens_BS = np.asarray(tokens_BS)
    batch = tokens_BS.shape[0]
    padded_BS = np.pad(tokens_BS, [(0, -batch % shards), (0, 0)])  # All-PAD rows.
    key_data = np.asarray(jax.random.key_data(rng))
    if rng.ndim:  # One key per row: split with the rows (the padding rows' keys are zeros).
      key_data = sharding.from_host(np.pad(key_data, [(0, -batch % shards), (0, 0)]), rows)
    else:
      key_data = sharding.from_host(key_data, sharding.replicated(mesh))
    with sharding.activated(mesh, rules):
      outputs = jitted(params, sharding.from_host(padded_BS, rows), key_data)
    return jax.tree.map(lambda x: sharding.to_host(x)[:batch], outputs)

  return sharded_decode


def decode_steps(input_len: int, options: DecodeOptions, first_pass: bool) -> tuple[int, int]:
  """(`max_decode_len`, `max_steps`) of a decoder for inputs `input_len` wide.

  The length limit is the width + `options.max_extra_len` (the paper's limit for
  translation; for prompts, the new tokens); the steps are those of `first_pass_steps`
  in a first pass (`TwoPass`), else all of them.
  """
  max_decode_len = input_len + options.max_extra_len
  return max_decode_len, (
    first_pass_steps(input_len, max_decode_len) if first_pass else max_decode_len
  )


def first_pass_steps(input_len: int, max_decode_len: int) -> int:
  """Steps of the first decoding pass (`TwoPass`) for inputs (sources, prompts) `input_len` wide.

  Twice the width: an output (a translation; a prompt with its continuation) rarely needs
  more, while the length limit, the width + `max_extra_len` (50), is usually far longer.
  Every step costs in proportion to the self-attention cache, which is sized to the pass's
  steps. At least 24: with shorter caches XLA:CPU sums the attention in another order, and
  the logits would differ from one pass's in the last bits (docs/benchmarks.md).
  """
  return min(max_decode_len, max(24, 2 * input_len))


def two_pass_fn(decode_fn, mesh: Mesh | None, rules: sharding.Rules) -> TwoPass:
  """`decode_fn(params, tokens_BS, rng, *, first_pass)` in two passes, each jitted (`jit_rows`)."""
  return TwoPass(
    jit_rows(functools.partial(decode_fn, first_pass=True), mesh, rules),
    jit_rows(functools.partial(decode_fn, first_pass=False), mesh, rules),
  )


@dataclasses.dataclass
class TwoPass:
  """Decodes in a short first pass, and again in full the rows it left unfinished.

  `first_fn` and `full_fn`: `(params, tokens_BS, rng) -> decoding.Decoded`, the same
  decoder with a few steps (and a cache sized to them) and with all of them; both
  return tokens of the full width. For decoders whose output for a row does not depend
  on the other rows of its batch (beam search, greedy, sampling with a key per row):
  then the result is exactly the full decoder's, and a batch costs the steps its rows
  need rather than its length limit. The unfinished rows (rare: outputs much longer
  than their input) go again in batches of `second_pass_rows` rows, one compiled
  shape per input width, each row with its own key. Called like `first_fn` (`rng`: a
  key per row, or one, whose `fold_in(rng, b)` is row b's, as `decoding.sample_decode`
  reads it); returns the tokens as a host array.
  """

  first_fn: Callable[..., decoding.Decoded]
  full_fn: Callable[..., decoding.Decoded]
  second_pass_rows: int = 8
  rows_again: int = 0  # Rows decoded a second time, over all calls.
  # Calls may come from several threads at once (`decode_batches`' concurrency).
  _count_lock: threading.Lock = dataclasses.field(
    default_factory=threading.Lock, repr=False, compare=False
  )

  def __call__(self, params, tokens_BS, rng: jax.Array) -> np.ndarray:
    if rng.ndim == 0:
      rng = _row_keys(rng, np.arange(tokens_BS.shape[0]))
    first = self.first_fn(params, tokens_BS, rng)
    tokens_BT, done_B = np.array(first.tokens), np.asarray(first.done)
    again = np.flatnonzero(~done_B)
    for start in range(0, len(again), self.second_pass_rows):
      rows = again[start : start + self.second_pass_rows]
      picked = np.zeros(self.second_pass_rows, np.int32)  # The padding rows take row 0's key.
      picked[: len(rows)] = rows
      rows_BS = np.zeros((self.second_pass_rows, tokens_BS.shape[1]), np.int32)  # PAD rows.
      rows_BS[: len(rows)] = np.asarray(tokens_BS)[rows]
      again_BT = self.full_fn(params, rows_BS, rng[picked]).tokens
      tokens_BT[rows] = np.asarray(again_BT)[: len(rows)]
    with self._count_lock:
      self.rows_again += len(again)
    return tokens_BT


def length_sorted_batches(
  batches: Iterable[dict[str, np.ndarray]],
  *,
  max_tokens: int,
  max_rows: int,
  max_len: int,
  input_key: str = 'src_tokens',
) -> list[dict[str, np.ndarray]]:
  """Decoding batches regrouped by input length, so that a batch's rows end together.

  Takes the valid rows of `batches` (as `tasks.translation.data.translation_batches` or
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
    raise InvalidInput(f'max_tokens={max_tokens} and max_rows={max_rows} must be positive.')
  rows, indices = [], []
  for batch in batches:
    for tokens, index, valid in zip(batch[input_key], batch['index'], batch['valid'], strict=True):
      if valid:
        rows.append(tokens[: np.count_nonzero(tokens)] if tokens.any() else tokens[:0])
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
    for row, i in enumerate(order[start : start + count]):
      tokens_BS[row, : len(rows[i])] = rows[i]
      index_B[row] = indices[i]
    out.append({input_key: tokens_BS, 'index': index_B, 'valid': np.arange(size) < count})
    start += count
  return out


_row_keys = jax.jit(decoding.row_keys)  # Each batch's keys, in one compiled call.


def decode_in_order(
  decode_fn, params, batches: Iterable[dict[str, np.ndarray]], rng, input_key: str, concurrency: int
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
  """(batch, its output tokens) in batch order; up to `concurrency` batches decoding at once.

  Each row is decoded with its own key, `jax.random.fold_in(rng, index)` of the row's
  `index` (its input's position): a sampled output depends on the seed and its input
  alone, not on the batch it lands in, the batch size, the device or how many batches
  run at once. Closing the iterator early waits for the batches in flight.
  """

  def decode(batch: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(decode_fn(params, batch[input_key], _row_keys(rng, batch['index'])))

  if concurrency <= 1:
    for batch in batches:
      yield batch, decode(batch)
    return
  with concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix='decode') as pool:
    in_flight = collections.deque()
    try:
      for batch in batches:
        in_flight.append((batch, pool.submit(decode, batch)))
        if len(in_flight) == concurrency:
          batch, future = in_flight.popleft()
          yield batch, future.result()
      while in_flight:
        batch, future = in_flight.popleft()
        yield batch, future.result()
    finally:
      for _, future in in_flight:
        future.cancel()


def decode_batches(
  decode_fn,
  params,
  batches: Iterable[dict[str, np.ndarray]],
  tokenizer: tokenizer_lib.Tokenizer,
  rng: jax.Array,
  max_sentences: int | None = None,
  input_key: str = 'src_tokens',
  concurrency: int = 1,
) -> tuple[dict[int, str], dict[str, float]]:
  """Detokenized outputs keyed by input index, and decode-speed figures.

  `decode_fn(params, tokens, rng)` is a task's decoding function
  (`translation.decode.make_translate_fn`, or `language_model.generate.make_generate_fn` with
  `input_key='prompt_tokens'`).
  With `max_sentences`, stops after the batch that reaches that many sentences.
  `concurrency` batches are decoded at once (`concurrent_batches`), in threads; the
  outputs are those of one at a time.
  """
  translations: dict[int, str] = {}
  num_tokens = 0
  start = time.perf_counter()
  decoded = decode_in_order(decode_fn, params, batches, rng, input_key, concurrency)
  with contextlib.closing(decoded):
    for batch, tokens in decoded:
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
