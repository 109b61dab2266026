"""The language-model task (`tasks.Task`): monolingual text, the decoder-only model, perplexity.

Its concerns are one module each: `data` (documents cut into windows, prompts),
`generate` (prompts continued by the model) and `evaluate` (perplexity, also by
position and window length); `LanguageModel` is what training, evaluation and
eval.py call.
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
from transformer.tasks.language_model import data, evaluate, generate


class LanguageModel:
  """The language-model task as training, evaluation and eval.py use it (`tasks.Task`)."""

  name = 'language model'
  batch_keys = data.BATCH_KEYS
  unsupported_eval_flags = ('watch', 'attention_plot')  # eval.py's flags that do not apply.
  default_decoder = 'greedy'  # Beam search is for translation.
  train_iterator = staticmethod(data.train_iterator)
  eval_batches = staticmethod(data.eval_batches)
  make_decode_fn = staticmethod(generate.make_generate_fn)
  evaluator = staticmethod(evaluate.evaluator)

  @staticmethod
  def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `Transformer.__call__` for a batch of `batch_keys` (no source)."""
    return {
      'src_tokens_BS': None,
      'tgt_input_tokens_BL': batch['tgt_input_tokens'],
      'tgt_segments_BL': batch['tgt_segments'],
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
    """None: the validation loss training logs already gives the perplexity."""
    return lambda params: {}

  @staticmethod
  def decode_option_errors(
    config: ml_collections.ConfigDict, options: inference.DecodeOptions
  ) -> list[str]:
    """eval.py's decoding options that this model cannot decode with."""
    if options.decoder == 'beam':
      return ['A language model continues prompts with --decoder=greedy or sample.']
    return []

  @staticmethod
  def decode_lines(request: task.EvalRequest, params: Any, lines: Sequence[str]) -> list[str]:
    """Each line (a prompt) followed by its continuation (`generate.continue_prompts`)."""
    return generate.continue_prompts(
      request.config,
      request.model_config,
      params,
      lines,
      options=request.options,
      batch_size=request.batch_size,
      seed=request.seed,
      mesh=request.mesh,
      rules=request.rules,
    )
