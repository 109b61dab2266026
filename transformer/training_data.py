"""A training run's data: prepared once across processes, then its batches and validation.

`load` gives `training._set_up` the training iterator (batches placed on the mesh ahead of
their step), the validation split's batches and metrics (BLEU), and the inputs' content for the
provenance record; `prepare` makes the data and vocabulary once when several processes share a
filesystem.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import ml_collections
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from transformer import input_pipeline, runs, sharding, tasks, tokenizer
from transformer.model import Transformer

# Training batches are placed on the devices this many steps before the step that uses them.
PREFETCH_BATCHES = 2


def load(
  config: ml_collections.ConfigDict,
  workdir: str,
  task: tasks.Task,
  eval_model: Transformer,
  mesh: Mesh,
  rules: sharding.Rules,
  cleanup: contextlib.ExitStack,
):
  """The training iterator, the validation batches and metrics, and the inputs' content.

  Every split is prepared and checked (e.g. that config.data.eval_split exists)
  before the workdir changes.
  """
  vocab = prepare(config.data, config.vocab_size, config.seed)
  # A vocabulary trained just now (none existed at `check_resume`) must be the recorded one too.
  run_inputs = runs.check_inputs(config, workdir, vocab.serialized_model())
  train_iter = input_pipeline.DevicePrefetch(
    task.train_iterator(
      config.data,
      vocab,
      seed=config.seed,
      shard_index=jax.process_index(),
      shard_count=jax.process_count(),
    ),
    lambda batch: sharding.global_batch(batch, mesh, rules),
    PREFETCH_BATCHES,
  )
  # However the run ends: its worker processes (config.data.num_workers) stop, and the shared
  # memory of their batches is unlinked (`DevicePrefetch.close`).
  cleanup.callback(train_iter.close)
  validation_metrics = task.validation_metrics_fn(
    config.data, tasks.ValidationConfig.from_config(config), eval_model.config, vocab, mesh, rules
  )
  eval_batches = task.eval_batches(
    config.data,
    vocab,
    config.data.eval_split,
    rows_multiple_of=sharding.batch_shards(dict(mesh.shape), rules),
    shard_index=jax.process_index(),
    shard_count=jax.process_count(),
  )
  return train_iter, eval_batches, validation_metrics, run_inputs


def prepare(
  data_config: ml_collections.ConfigDict, vocab_size: int, seed: int
) -> tokenizer.Tokenizer:
  """Prepares the data and vocabulary once, then loads the vocabulary on every process.

  Process 0 goes first, so that processes sharing a filesystem never write the
  same files at once; the others then find them ready (or, on hosts with their
  own disks, prepare their own copy).
  """
  get_vocab = functools.partial(
    tokenizer.get_tokenizer, data_config, vocab_size=vocab_size, seed=seed
  )
  if jax.process_count() == 1:
    return get_vocab()
  vocab = get_vocab() if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices('data prepared')
  return vocab or get_vocab()
