"""The two tasks, chosen once per run from the config: translation and language modelling.

`get_task(config)` returns the task of `config.model.architecture` (validation
has checked that `config.data.dataset` fits it). Training, evaluation and
eval.py ask the task, never "is this a language model?". Each task is a class
with the same members:

  name                    'translation' or 'language model', for messages.
  batch_keys              the keys of its training and evaluation batches.
  train_iterator(config, tokenizer, *, shard_index, shard_count)
                          the infinite, checkpointable iterator of packed
                          training batches of one process.
  eval_batches(config, tokenizer, split, *, rows_multiple_of, shard_index,
               shard_count)
                          the packed batches of a whole split, for the loss.
  model_inputs(batch)     the keyword arguments of `Transformer.__call__`.
  validation_metrics_fn(config, model_config, tokenizer, mesh, rules)
                          `params -> metrics` added to each evaluation during
                          training (BLEU for translation).
  make_decode_fn(model_config, options, mesh, rules)
                          `(params, tokens, rng) -> tokens`, jitted:
                          translation or continuation of a prompt.

and, for eval.py:

  default_decoder         the decoder when --decoder is not given.
  unsupported_eval_flags  eval.py's flags that do not apply (an error if set).
  decode_option_errors(config, options)
                          decoding options this model cannot decode with.
  decode_lines(config, model_config, params, lines, *, options, batch_size,
               seed, max_tokens, mesh, rules)
                          one output per input line (translations, or
                          prompts continued).
  evaluate_checkpoint(config, model_config, params, *, workdir, label, split,
                      options, ...)
                          scores a split (BLEU, or perplexity), writes
                          WORKDIR/eval/ and returns what eval.py prints.
  watch(...)              translation only (`--watch` is unsupported for a
                          language model): evaluates each new checkpoint.

Both pack their examples with the shared `input_pipeline.packed_train_iterator`
and `packed_eval_batches`, and decode through `inference.run_decoder`.
"""

from __future__ import annotations

import ml_collections

from transformer.tasks.language_model import LanguageModel
from transformer.tasks.translation import Translation

Task = Translation | LanguageModel


def get_task(config: ml_collections.ConfigDict) -> Task:
  """The task of `config`: a decoder-only model is a language model, else translation."""
  return LanguageModel() if config.model.architecture == 'decoder_only' else Translation()
