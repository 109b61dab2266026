"""convert.py's jobs on workdirs: a run's checkpoint out to Hugging Face or CTranslate2, and a
Hugging Face Marian directory in as a workdir that eval.py scores and train.py fine-tunes from.

- `export_hf` / `export_ctranslate2`: the parameters of `--checkpoint` (`latest`, a step,
  `avg:N`, `best`, ... as eval.py reads them, averaging included) and the run's vocabulary.
- `load_hf`: a Marian directory as this project's config fields, parameters and vocabulary
  (`config.init_from=hf:DIR` starts a run from it).
- `import_hf`: the same written as a workdir: `config.json` (the architecture stated in
  `config.model`), `vocabulary.model`, `checkpoints/0` and a provenance entry naming the
  source. Such a workdir is a starting point, not a run to resume: train.py refuses to
  resume it and says to fine-tune it in a new workdir (`config.init_from=WORKDIR`).

Nothing is written where something already is: an output directory must be new or empty.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Collection
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from transformer import (
  checkpoints,
  evaluation,
  extras,
  optim,
  path_checks,
  provenance,
  runs,
  storage,
)
from transformer import config as config_lib
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.errors import InvalidInput
from transformer.interop import ctranslate2_model, hf_files, marian

VOCABULARY_FILE = 'vocabulary.model'  # An imported workdir's vocabulary (path_checks.RUN_ENTRIES).
TARGET_VOCABULARY_FILE = 'target_vocabulary.model'  # Its target side's, where it has its own.
IMPORTED_KEY = provenance.IMPORTED_KEY  # Its provenance entry's record of the source.


def check_new_output(path: str, flag: str, inputs: dict[str, str | None] | None = None) -> str:
  """`path` made absolute, checked before any work: refused if something is there already
  (nothing is overwritten), if it is or lies in a run's files, one of `inputs` or the code
  (`path_checks.protected_path_errors`, the rule of every output), or if it cannot be written."""
  if not path or not path.strip():
    raise InvalidInput(f'{flag} is empty: name a new directory.')
  if storage.is_url(path):
    raise InvalidInput(f'{flag}={path}: write it to a local directory, then copy it to a bucket.')
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isfile(path):
    raise InvalidInput(f'{flag}={path} is a file: name a new directory.')
  if errors := path_checks.output_dir_errors(path, flag, inputs):
    raise InvalidInput(errors[0])
  if os.path.isdir(path) and os.listdir(path):
    raise InvalidInput(f'{flag}={path} is not empty: name a new directory (nothing is replaced).')
  return path


@dataclasses.dataclass(frozen=True)
class RunParams:
  """A run's parameters as numpy arrays, with what describes them."""

  config: ml_collections.ConfigDict
  model_config: ModelConfig
  params: Any
  label: str  # Which checkpoints: `step_1500`, `avg5_1100-1500`, ...
  vocabulary: bytes
  target_vocabulary: bytes | None = None  # The target side's own model, where it has one.


def run_model_config(workdir: str) -> tuple[ml_collections.ConfigDict, ModelConfig]:
  """The run's config (fitted to this machine) and its model, before anything is restored."""
  config = evaluation.load_run_config(workdir)
  return config, ModelConfig.from_config(config)


def read_run(workdir: str, checkpoint: str | None) -> RunParams:
  """The parameters of `checkpoint` (default: the run's config.decode.checkpoint), on the host."""
  config = evaluation.load_run_config(workdir)
  run = evaluation.setup(config)
  spec = checkpoint or config.decode.checkpoint
  params, label = evaluation.restore_params(run, workdir, spec)
  params = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), params)
  vocabulary = storage.read_bytes(tokenizer_lib.vocab_path(config.data, config.vocab_size))
  target_path = tokenizer_lib.target_vocab_path(config.data)
  target = storage.read_bytes(target_path) if target_path else None
  return RunParams(config, run.model_config, params, label, vocabulary, target)


def export_hf(
  workdir: str, directory: str, checkpoint: str | None, *, allow_norm_epsilon: bool = False
) -> list[str]:
  """Writes `directory` as a Hugging Face Marian model of the run's `checkpoint`."""
  directory = check_new_output(directory, '--to_hf')
  _, model_config = run_model_config(workdir)
  refusals = marian.export_refusals(model_config, allow_norm_epsilon=allow_norm_epsilon)
  if refusals:  # Before anything is restored.
    raise InvalidInput(
      f'The run in {workdir} has no exact Hugging Face Marian form:\n  ' + '\n  '.join(refusals)
    )
  run = read_run(workdir, checkpoint)
  if run.model_config.norm_epsilon != marian.MARIAN_NORM_EPSILON:
    logging.warning(
      "Exporting with norm_epsilon=%g where Marian's LayerNorm uses %g "
      '(--allow_norm_epsilon): transformers computes slightly different numbers.',
      run.model_config.norm_epsilon,
      marian.MARIAN_NORM_EPSILON,
    )
  files = hf_files.write(
    directory,
    run.params,
    run.model_config,
    run.vocabulary,
    target_vocabulary=run.target_vocabulary,
    source_lang=run.config.data.source_lang,
    target_lang=run.config.data.target_lang,
    beam_size=run.config.decode.beam_size,
    alpha=run.config.decode.alpha,
    allow_norm_epsilon=allow_norm_epsilon,
  )
  logging.info('Wrote %s (%s of %s): %s.', directory, run.label, workdir, ', '.join(files))
  return files


def export_ctranslate2(
  workdir: str, directory: str, checkpoint: str | None, *, quantization: str = 'float32'
) -> None:
  """Writes `directory` as a CTranslate2 model of the run's `checkpoint`."""
  directory = check_new_output(directory, '--to_ctranslate2')
  if quantization not in ctranslate2_model.QUANTIZATIONS:
    raise InvalidInput(
      f'--quantization={quantization!r} is not one of {ctranslate2_model.QUANTIZATIONS}.'
    )
  extras.require('ctranslate2', 'interop', '--to_ctranslate2')  # Before the run is read.
  _, model_config = run_model_config(workdir)
  refusals = ctranslate2_model.refusals(model_config)
  if refusals:
    raise InvalidInput(
      f'The run in {workdir} has no exact CTranslate2 form:\n  ' + '\n  '.join(refusals)
    )
  run = read_run(workdir, checkpoint)
  ctranslate2_model.write(
    directory,
    run.params,
    run.model_config,
    run.vocabulary,
    quantization=quantization,
    target_vocabulary=run.target_vocabulary,
  )
  logging.info(
    'Wrote the CTranslate2 model %s (%s of %s, %s).', directory, run.label, workdir, quantization
  )


@dataclasses.dataclass(frozen=True)
class Imported:
  """A Hugging Face Marian model in this project's terms."""

  directory: str
  fields: dict[str, Any]  # `vocab_size`, `model.*` and `decode.*` of the config.
  params: Any  # numpy float32, this project's tree.
  vocabulary: bytes  # The SentencePiece model, in this project's id order.
  target_vocabulary: bytes | None  # The target side's (same pieces and ids); None: the same.
  languages: tuple[str | None, str | None] = (None, None)  # tokenizer_config.json's sides.


def load_hf(directory: str) -> Imported:
  """Reads a Marian directory into this project's fields, parameters and vocabulary.

  Everything is read and checked before anything is returned (so before a caller writes):
  refused, naming the file, for each config.json key without an exact form here, weights
  that are not the model config.json states (a shape, naming the tensor and the keys; NaN or
  inf; a tensor missing or unknown), and a file that is damaged. A target.spm that differs
  from source.spm (OPUS-MT's: a model per language over one joint vocab.json) is kept as the
  target side's own model, with the same pieces and ids.
  """
  if storage.is_url(directory):
    copy = {'gs': 'gcloud storage cp -r', 's3': 'aws s3 sync'}.get(
      directory.split('://', 1)[0], 'gcloud storage cp -r (or aws s3 sync)'
    )
    raise InvalidInput(
      f'--from_hf={directory}: imports read a local directory. Copy the bucket folder to this '
      f'host first ({copy} {directory} DIR), then name the copy: --from_hf=DIR.'
    )
  directory = os.path.abspath(os.path.expanduser(directory))
  if not os.path.isdir(directory):
    raise InvalidInput(f'--from_hf={directory} is not a directory.')
  marian_config = hf_files.read_config(directory)
  if _tokenizer_config(directory).get('separate_vocabs'):
    raise InvalidInput(
      f'{directory}/tokenizer_config.json separate_vocabs=true: its sides have ids of their '
      'own (vocab.json, target_vocab.json); here one id names one piece on both sides.'
    )
  state = hf_files.read_checked_weights(directory, marian_config)
  order, source, target = hf_files.read_tokenizer(directory, marian_config)
  fields = marian.model_fields(
    marian_config, vocab_size=len(order), logits_bias=marian.nonzero_logits_bias(state)
  )
  fields['decode'] = _decode_fields(directory)
  languages = _languages(directory)
  cfg = ModelConfig(vocab_size=fields['vocab_size'], **fields['model'])
  try:
    params = marian.from_marian(state, cfg, order)
  except KeyError as e:
    raise InvalidInput(f'{directory}: {e.args[0]}') from None
  return Imported(
    directory, fields, params, source, None if target == source else target, languages
  )


def _decode_fields(directory: str) -> dict[str, Any]:
  """`decode.*` from generation_config.json (beam size; GNMT alpha of its length penalty)."""
  path = os.path.join(directory, 'generation_config.json')
  if not os.path.isfile(path):
    return {}
  generation = hf_files.read_json_object(path)
  fields = {}
  if isinstance(generation.get('num_beams'), int) and generation['num_beams'] >= 1:
    fields['beam_size'] = generation['num_beams']
  penalty = generation.get('length_penalty')
  if isinstance(penalty, int | float) and penalty >= 0:
    length = hf_files.TYPICAL_TARGET_LENGTH
    fields['alpha'] = round(float(penalty) * (5 + length) / length, 6)
  return fields


def _tokenizer_config(directory: str) -> dict[str, Any]:
  """tokenizer_config.json of DIR, {} where there is none."""
  path = os.path.join(directory, 'tokenizer_config.json')
  return hf_files.read_json_object(path) if os.path.isfile(path) else {}


def _languages(directory: str) -> tuple[str | None, str | None]:
  """tokenizer_config.json's source_lang and target_lang (None where it names none)."""
  loaded = _tokenizer_config(directory)
  sides = loaded.get('source_lang'), loaded.get('target_lang')
  for key, side in zip(('source_lang', 'target_lang'), sides, strict=True):
    if side is not None and not (isinstance(side, str) and side.strip()):
      raise InvalidInput(
        f'{directory}/tokenizer_config.json {key}={side!r}: name a language (a string) or '
        'leave it out.'
      )
  return sides[0] or None, sides[1] or None


def params_digest(params: Any) -> str:
  """sha256 over the arrays' names, shapes, dtypes and bytes (the provenance of a start)."""
  digest = hashlib.sha256()
  for path, leaf in sorted(
    jax.tree_util.tree_flatten_with_path(params)[0], key=lambda item: jax.tree_util.keystr(item[0])
  ):
    array = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f'{jax.tree_util.keystr(path)}:{array.shape}:{array.dtype};'.encode())
    digest.update(array.tobytes())
  return digest.hexdigest()


def apply_fields(
  config: ml_collections.ConfigDict, fields: dict[str, Any], keep: Collection[str] = ()
) -> None:
  """Sets the imported model's `vocab_size`, `model.*` and `decode.*` on `config`, but for
  the `decode.*` keys in `keep` (set on the command line: the user's choice of decoding)."""
  config.vocab_size = fields['vocab_size']
  for group in ('model', 'decode'):
    for key, value in fields.get(group, {}).items():
      if f'{group}.{key}' not in keep:
        config[group][key] = value


# What an imported model's directory gives (its config.json, vocabulary files): an override of
# one of these on the command line would be dropped, so it is refused.
_FROM_THE_DIRECTORY = ('vocab_size', 'data.vocab_path', 'data.target_vocab_path')


def import_override_errors(overridden: Collection[str], directory: str) -> list[str]:
  """The command line's overrides (`--config.KEY`) of fields that `directory` gives."""
  return [
    f'--config.{key}: the imported model takes it from {directory} (its config.json and '
    'vocabulary files), so an override would be dropped; leave it out.'
    for key in sorted(overridden)
    if key in _FROM_THE_DIRECTORY or key.startswith('model.')
  ]


def _fit_lengths(
  config: ml_collections.ConfigDict, overridden: Collection[str], directory: str
) -> None:
  """Lowers config.data's lengths the command line did not set to the model's positions
  (the directory's max_position_embeddings); one it set beyond them is refused."""
  limit, data = config.model.max_len, config.data
  too_long = [key for key in ('max_len', 'max_eval_len') if data[key] > limit]
  where = f"{directory}/config.json max_position_embeddings={limit}, the model's positions"
  refused = [f'--config.data.{key}={data[key]}' for key in too_long if f'data.{key}' in overridden]
  if refused:
    verb = 'exceeds' if len(refused) == 1 else 'exceed'
    raise InvalidInput(
      f'{" and ".join(refused)} {verb} {where}: set at most {limit}, or leave it out (the '
      "config file's value is then lowered to it)."
    )
  for key in too_long:
    logging.info('config.data.%s=%d lowered to %d (%s).', key, data[key], limit, where)
    data[key] = limit
  if 'max_len' in too_long and 'data.tokens_per_batch' not in overridden:
    data.tokens_per_batch = max(data.tokens_per_batch // limit, 1) * limit


def import_hf(
  directory: str,
  workdir: str,
  config: ml_collections.ConfigDict,
  overridden: Collection[str] = (),
) -> str:
  """Writes `workdir` holding the Marian model of `directory`; `config` gives data and training.

  Returns the checkpoint's directory. The config's model fields, vocab_size and decoding
  are the imported model's (an override of the model or vocabulary is refused, one of the
  decoding kept: `overridden`, the keys set on the command line); its data lengths the
  command line did not set are fitted to the model's positions. `data.vocab_path` is
  WORKDIR/vocabulary.model. On a failure nothing is left behind.
  """
  workdir = check_new_output(
    workdir, '--workdir', {'the Hugging Face directory (--from_hf)': directory}
  )
  if errors := import_override_errors(overridden, directory):
    raise InvalidInput('\n  '.join(['Invalid overrides:', *errors]))
  imported = load_hf(directory)
  config = ml_collections.ConfigDict(config.to_dict())
  apply_fields(config, imported.fields, keep=overridden)
  _fit_lengths(config, overridden, imported.directory)
  config.data.vocab_path = os.path.join(workdir, VOCABULARY_FILE)
  if imported.target_vocabulary is not None:
    config.data.target_vocab_path = os.path.join(workdir, TARGET_VOCABULARY_FILE)
  for side, name in zip(imported.languages, ('source_lang', 'target_lang'), strict=True):
    if side and config.data[name] and side != config.data[name]:
      logging.warning(
        '%s/tokenizer_config.json names %s=%r; the config reads config.data.%s=%r.',
        directory,
        name,
        side,
        name,
        config.data[name],
      )
  config_lib.validate(config, num_devices=jax.device_count())
  state = _train_state(evaluation.setup(config), imported.params, config)  # Before any write.
  existed = os.path.isdir(workdir)
  try:
    _write_workdir(workdir, imported, config, state)
  except BaseException:
    shutil.rmtree(workdir, ignore_errors=True)  # It was new or empty (`check_new_output`).
    if existed:
      os.makedirs(workdir, exist_ok=True)
    raise
  logging.info('Imported %s into %s (step 0).', imported.directory, workdir)
  return storage.join(workdir, 'checkpoints')


def _write_workdir(
  workdir: str, imported: Imported, config: ml_collections.ConfigDict, state: Any
) -> None:
  """The imported workdir's files: vocabularies, checkpoint 0, config.json, provenance."""
  os.makedirs(workdir, exist_ok=True)
  storage.write_bytes(config.data.vocab_path, imported.vocabulary)
  if imported.target_vocabulary is not None:
    storage.write_bytes(config.data.target_vocab_path, imported.target_vocabulary)
  checkpointer = checkpoints.Checkpointer(workdir)
  try:
    # The data item of a checkpoint is an input position; an imported model has none to keep
    # (train.py refuses to resume this workdir), so it is the start of an empty dataset.
    import grain  # pylint: disable=g-import-not-at-top

    position = iter(grain.MapDataset.range(1).to_iter_dataset())
    checkpointer.save(0, state, position, force=True)
    checkpointer.wait_until_finished()
  finally:
    checkpointer.close()
  runs.write_config(config, workdir)
  entry = provenance.current()
  entry[IMPORTED_KEY] = {
    'path': imported.directory,
    'params_sha256': params_digest(imported.params),
  }
  entry['inputs'] = {'vocabulary': provenance.vocabulary_input(config, imported.vocabulary)}
  if target := provenance.target_vocabulary_input(config):
    entry['inputs']['target_vocabulary'] = target
  storage.append_text(
    storage.join(workdir, provenance.FILENAME), json.dumps(entry, sort_keys=True) + '\n'
  )


def _train_state(run: evaluation.Setup, params: Any, config: ml_collections.ConfigDict):
  """A train state at step 0 holding `params`, placed as the config's mesh lays it out."""
  from transformer import train_steps  # pylint: disable=g-import-not-at-top

  abstract = run.abstract_state
  placed = jax.tree.map(
    lambda value, target: jax.device_put(np.asarray(value, target.dtype), target.sharding),
    params,
    abstract.params,
  )
  optimizer = optim.create_optimizer(optim.OptimizerConfig.from_config(config))
  opt_state = jax.jit(
    optimizer.init, out_shardings=jax.tree.map(lambda a: a.sharding, abstract.opt_state)
  )(placed)
  return train_steps.TrainState(
    step=jax.device_put(np.asarray(0, np.int32), abstract.step.sharding),
    params=placed,
    opt_state=opt_state,
    dropout_key=jax.device_put(
      np.asarray(jax.random.key_data(jax.random.key(config.seed))), abstract.dropout_key.sharding
    ),
  )


def imported_from(workdir: str) -> dict[str, Any] | None:
  """The source recorded by `import_hf` in WORKDIR's provenance, or None."""
  for entry in provenance.read(workdir):
    if IMPORTED_KEY in entry:
      return entry[IMPORTED_KEY]
  return None
