"""The translation task (`tasks.Task`): parallel text, the encoder-decoder, BLEU, beam search.

Its concerns are one module each: `data` (batches), `decode` (translating with
the model) and `evaluate` (BLEU during training, a split scored for eval.py);
`Translation` is what training, evaluation and eval.py call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
from jax.sharding import Mesh

from transformer import inference, sharding
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.tasks import task
from transformer.tasks.translation import data, decode, evaluate


class Translation:
  """The translation task as training, evaluation and eval.py use it (`tasks.Task`)."""

  name = 'translation'
  batch_keys = data.BATCH_KEYS
  unsupported_eval_flags = ('prompt', 'lengths')  # eval.py's flags that do not apply.
  default_decoder = 'beam'  # The paper's.
  train_iterator = staticmethod(data.train_iterator)
  eval_batches = staticmethod(data.eval_batches)
  make_decode_fn = staticmethod(decode.make_translate_fn)
  evaluator = staticmethod(evaluate.evaluator)

  @staticmethod
  def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `Transformer.__call__` for a batch of `batch_keys`."""
    return {
      'src_tokens_BS': batch['src_tokens'],
      'tgt_input_tokens_BL': batch['tgt_input_tokens'],
      'src_segments_BS': batch['src_segments'],
      'tgt_segments_BL': batch['tgt_segments'],
      'src_positions_BS': batch['src_positions'],
      'tgt_positions_BL': batch['tgt_positions'],
    }

  @staticmethod
  def validation_metrics_fn(
    data_config: ml_collections.ConfigDict,
    validation: task.ValidationConfig,
    model_config: ModelConfig,
    tokenizer: tokenizer_lib.Tokenizer,
    mesh: Mesh,
    rules: sharding.Rules,
  ) -> Callable[[Any], dict[str, float]]:
    """`params -> metrics` that training adds to each evaluation.

    BLEU of the first `config.eval_bleu_sentences` validation sentences (none
    if 0), decoded by `config.eval_bleu_decoder` with `config.decode`'s settings.
    """
    if validation.eval_bleu_sentences == 0:
      return lambda params: {}
    translate_fn = decode.make_translate_fn(model_config, validation.decode_options(), mesh, rules)
    return lambda params: evaluate.validation_bleu(
      data_config, validation, params, tokenizer, translate_fn, mesh
    )

  @staticmethod
  def decode_option_errors(
    config: ml_collections.ConfigDict, options: inference.DecodeOptions
  ) -> list[str]:
    """eval.py's decoding options that this model cannot decode with."""
    longest = config.data.max_eval_len + options.max_extra_len
    if longest > config.model.max_len:
      return [
        f'--max_extra_len={options.max_extra_len}: outputs of up to '
        f'config.data.max_eval_len + {options.max_extra_len} = {longest} tokens exceed '
        f'config.model.max_len={config.model.max_len}, the longest position the model '
        'supports.'
      ]
    return []

  @staticmethod
  def decode_lines(request: task.EvalRequest, params: Any, lines: Sequence[str]) -> list[str]:
    """One translation per input line (`decode.translate_lines`)."""
    return decode.translate_lines(
      request.config,
      request.model_config,
      params,
      lines,
      options=request.options,
      batch_size=request.batch_size,
      seed=request.seed,
      max_tokens=request.max_tokens,
      mesh=request.mesh,
      rules=request.rules,
    )
