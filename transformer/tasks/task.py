"""The task contract: the `Task` protocol both tasks implement, and what eval.py passes them.

Training, evaluation and eval.py ask the task of a run (`tasks.get_task`), never
"is this a language model?". `tests/test_tasks.py` checks that each task
implements `Task` member by member, signatures included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import grain
import ml_collections
from jax.sharding import Mesh

from transformer import config_fields, inference, scoring, sharding
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ValidationConfig(config_fields.Part):
  """The fields of a config that a task's validation metrics read (BLEU for translation)."""

  eval_bleu_sentences: int  # Validation sentences decoded per evaluation (0: none).
  eval_bleu_decoder: str  # 'greedy' or 'beam', with config.decode's settings:
  beam_size: int = config_fields.from_key('decode.beam_size')
  alpha: float = config_fields.from_key('decode.alpha')
  max_extra_len: int = config_fields.from_key('decode.max_extra_len')
  seed: int = config_fields.from_key('seed')  # Of the decoder's key.

  def decode_options(self) -> inference.DecodeOptions:
    return inference.DecodeOptions(
      self.eval_bleu_decoder,
      beam_size=self.beam_size,
      alpha=self.alpha,
      max_extra_len=self.max_extra_len,
    )


@dataclasses.dataclass(frozen=True)
class EvalRequest:
  """What eval.py asks a task for: the run (built once, `evaluation.setup`) and its flags.

  Each task reads the fields it needs: translation decodes with `options`,
  `batch_size`, `max_tokens` and `seed` and scores with `n_bootstrap`; a
  language model scores perplexity at each of `lengths` and continues prompts
  with `options`, `batch_size` and `seed`.
  """

  config: ml_collections.ConfigDict  # The run's resolved config.
  model_config: ModelConfig
  mesh: Mesh
  rules: sharding.Rules
  split: str  # The split to score.
  options: inference.DecodeOptions
  # Most sentences (prompts) decoded at once; None: `inference.batch_size`'s for `mesh`.
  batch_size: int | None = None
  max_tokens: int = inference.MAX_DECODE_TOKENS  # Source token slots per decoding batch.
  seed: int = 0  # Of the decoder's key (sampling).
  n_bootstrap: int = scoring.DEFAULT_BOOTSTRAP  # Resamples of each confidence interval.
  lengths: Sequence[int] = ()  # Window lengths for perplexity; empty: the evaluation length.


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """A checkpoint's scores on a split, as a task returns them (`evaluation.write` writes them).

  Files go to WORKDIR/eval/: `<checkpoint>-<split>[-<tag>].json` holds `results`,
  `.txt` beside it `lines` (if any), and `references-<split>.txt` the
  `references` (if any) that the lines were scored against.
  """

  results: dict[str, Any]  # Everything measured; the .json file.
  tag: str  # Names the decoding settings or the kind of score ('' for the default).
  summary: str  # What eval.py prints; `evaluation.watch` logs its first line.
  metrics: Mapping[str, float]  # The row that eval.py --watch logs for the checkpoint.
  lines: Sequence[str] | None = None  # One output line per line of the split's source.
  references: Sequence[str] | None = None  # The references, in the order of `lines`.


class Task(Protocol):
  """What training, evaluation and eval.py call on a task."""

  name: str  # For messages: 'translation' or 'language model'.
  batch_keys: tuple[str, ...]  # The keys of its training and evaluation batches.
  default_decoder: str  # eval.py's decoder when --decoder is not given.
  unsupported_eval_flags: tuple[str, ...]  # eval.py's flags that do not apply (an error if set).

  def train_iterator(
    self,
    data_config: ml_collections.ConfigDict,
    tokenizer: tokenizer_lib.Tokenizer,
    *,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
  ) -> grain.DatasetIterator:
    """The infinite, checkpointable iterator of packed training batches of one process."""

  def eval_batches(
    self,
    data_config: ml_collections.ConfigDict,
    tokenizer: tokenizer_lib.Tokenizer,
    split: str,
    *,
    rows_multiple_of: int = 1,
    shard_index: int = 0,
    shard_count: int = 1,
  ) -> grain.IterDataset:
    """The packed batches of a whole split, for the loss."""

  def model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `Transformer.__call__` for a batch of `batch_keys`."""

  def validation_metrics_fn(
    self,
    data_config: ml_collections.ConfigDict,
    validation: ValidationConfig,
    model_config: ModelConfig,
    tokenizer: tokenizer_lib.Tokenizer,
    mesh: Mesh,
    rules: sharding.Rules,
  ) -> Callable[[Any], dict[str, float]]:
    """`params -> metrics` that training adds to each evaluation (BLEU for translation)."""

  def make_decode_fn(
    self,
    model_config: ModelConfig,
    options: inference.DecodeOptions,
    mesh: Mesh | None = None,
    rules: sharding.Rules = (),
  ) -> Callable[..., Any]:
    """`(params, tokens, rng) -> tokens`, jitted: a translation, or a prompt continued."""

  def decode_option_errors(
    self, config: ml_collections.ConfigDict, options: inference.DecodeOptions
  ) -> list[str]:
    """eval.py's decoding options that this model cannot decode with."""

  def decode_lines(self, request: EvalRequest, params: Any, lines: Sequence[str]) -> list[str]:
    """One output per input line: its translation, or the prompt continued."""

  def evaluator(self, request: EvalRequest) -> Callable[[Any, str], Evaluation]:
    """`(params, checkpoint label) -> Evaluation` of `request.split`, compiled once.

    eval.py calls it once; `evaluation.watch` once per new checkpoint.
    """
