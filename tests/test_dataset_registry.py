"""A new dataset is one file (its builder) plus one registry entry: a made-up one trains.

The builder below is that one file (docs/data.md, "Adding a dataset"): tab-separated sentence
pairs, `SPLIT.tsv` in a manual_dir. Registering it is one entry in `registry.DATASETS`; nothing
else in the library learns its name.
"""

import hashlib
import inspect
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import synthetic_captions, write_lines
from etils import epath

from configs import tiny
from transformer import config as config_lib
from transformer import training
from transformer.datasets import registry

SPLITS = {'train': 1000, 'validation': 100}
REPO = pathlib.Path(__file__).resolve().parents[1]


class TsvPairs(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Made-up: English-German pairs, one `english<TAB>german` line each, in `SPLIT.tsv` files."""

  VERSION = tfds.core.Version('1.0.0')

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:  # As in ParallelText (TFDS's default needs a backport).
    return epath.Path(inspect.getfile(cls))

  def __init__(self, *, manual_dir: str, languages: Sequence[str] | None, **kwargs: Any):
    self._source_dir = manual_dir
    super().__init__(**kwargs)

  @classmethod
  def source_fingerprint(cls, manual_dir: str, languages: Sequence[str] | None) -> str:
    digest = hashlib.sha256()
    for split in sorted(SPLITS):
      digest.update(split.encode() + epath.Path(manual_dir, f'{split}.tsv').read_bytes())
    return digest.hexdigest()

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(
        {'translation': tfds.features.Translation(languages=('de', 'en')), 'index': np.int64}
      ),
    )

  def _split_generators(self, dl_manager):
    return {
      split: self._generate_examples(os.path.join(self._source_dir, f'{split}.tsv'))
      for split in SPLITS
    }

  def _generate_examples(self, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding='utf-8') as f:
      for index, line in enumerate(f):
        en, de = line.rstrip('\n').split('\t')
        yield index, {'translation': {'en': en, 'de': de}, 'index': index}


@pytest.fixture
def tsv_dir(tmp_path):
  for offset, (split, size) in enumerate(SPLITS.items()):
    pairs = synthetic_captions(size, seed=1000 * offset)  # The tiny corpus of conftest.
    write_lines(tmp_path / 'tsv' / f'{split}.tsv', [f'{en}\t{de}' for en, de in pairs])
  return tmp_path / 'tsv'


def _config(tsv_dir, data_dir):
  config = tiny.get_config()
  config.data.dataset = 'tsv_pairs'
  config.data.manual_dir, config.data.data_dir = str(tsv_dir), str(data_dir)
  config.num_train_steps = config.eval_every_steps = config.checkpoint_every_steps = 2
  config.eval_bleu_sentences = 0  # The loss only: no decoder to compile.
  return config


def test_an_unregistered_name_is_a_config_error(tsv_dir, tmp_path):
  config = _config(tsv_dir, tmp_path / 'tfds')
  assert config_lib.config_errors(config) == [
    f"config.data.dataset='tsv_pairs' is not one of {tuple(registry.DATASETS)}."
  ]


@pytest.mark.slow
def test_a_registered_dataset_trains(tsv_dir, tmp_path, monkeypatch):
  monkeypatch.setitem(
    registry.DATASETS,
    'tsv_pairs',
    registry.Dataset(TsvPairs, required_languages=registry.source_and_target),
  )
  config = _config(tsv_dir, tmp_path / 'tfds')
  final = training.train_and_evaluate(config, str(tmp_path / 'run'), jax.devices()[:1])
  assert np.isfinite(final['eval_loss'])
  metrics = (tmp_path / 'run' / 'metrics.jsonl').read_text()
  rows = [json.loads(line) for line in metrics.splitlines()]
  assert [row['step'] for row in rows if 'eval_loss' in row] == [2]
  # Prepared under <data_dir>/<name>-<fingerprint[:16]>/, the vocabulary named by its languages.
  (prepared,) = os.listdir(tmp_path / 'tfds')
  fingerprint = TsvPairs.source_fingerprint(str(tsv_dir), None)
  assert prepared == f'tsv_pairs-{fingerprint[:16]}'
  assert 'spm_de-en_512_20000.model' in os.listdir(tmp_path / 'tfds' / prepared)


def test_the_model_imports_no_data_code():
  script = "import sys, transformer.model; assert 'tensorflow_datasets' not in sys.modules"
  subprocess.run([sys.executable, '-c', script], check=True, cwd=REPO, timeout=120)
