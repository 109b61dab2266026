"""WMT14 En-De offline: the catalog builder prepares small archives in the release's names and
formats (plain parallel files, SGML newstest files) through the code a user runs, trains from
them, and a prepared data_dir copied to a machine without the archives trains the same."""

import shutil

import numpy as np
import pytest
from conftest import write_wmt14_release

from configs import tiny, wmt14_ende_base
from transformer import datasets, tokenizer, training
from transformer.datasets import wmt14
from transformer.tasks import translation

pytestmark = pytest.mark.slow


def _config(data_dir, manual_dir):
  config = tiny.shrink(wmt14_ende_base.get_config())
  config.vocab_size = 300
  config.num_train_steps, config.warmup_steps, config.log_every_steps = 3, 2, 1
  config.eval_every_steps = config.checkpoint_every_steps = 3
  config.eval_bleu_sentences = 0  # No decoder to compile: the data path is under test.
  config.data.data_dir = str(data_dir)
  config.data.manual_dir = str(manual_dir) if manual_dir else None
  return config


def test_wmt14_prepares_offline_from_release_archives_and_trains(tmp_path):
  raw = write_wmt14_release(tmp_path / 'raw', pairs_per_file=40)
  assert sorted(p.name for p in raw.iterdir()) == wmt14.archive_names('de-en')
  config = _config(tmp_path / 'tfds', raw)
  builder = datasets.prepare(config.data)
  assert builder.data_dir.endswith('wmt14_translate/de-en/1.0.0')
  sizes = {split: info.num_examples for split, info in builder.info.splits.items()}
  assert sizes == {'train': 120, 'validation': 20, 'test': 20}
  test = datasets.get_data_source(config.data, 'test')  # newstest2014, from SGML.
  assert all('<seg' not in datasets.translation_pair(ex, 'en', 'de')[0] for ex in test)

  final = training.train_and_evaluate(config, str(tmp_path / 'run'))
  assert np.isfinite(final['eval_loss'])

  # A compute node without the archives: copy the prepared data_dir (TFDS data, vocabulary,
  # prepared ids), no manual_dir. Nothing is downloaded or encoded again; training runs.
  copied = tmp_path / 'copied'
  shutil.copytree(tmp_path / 'tfds', copied, ignore=shutil.ignore_patterns('downloads'))
  copy_config = _config(copied, None)
  vocab = tokenizer.get_tokenizer(
    copy_config.data, vocab_size=copy_config.vocab_size, seed=copy_config.seed
  )
  want = next(translation.data.train_iterator(config.data, vocab, seed=config.seed))
  got = next(translation.data.train_iterator(copy_config.data, vocab, seed=copy_config.seed))
  for key in translation.data.BATCH_KEYS:
    np.testing.assert_array_equal(got[key], want[key])
  copy_final = training.train_and_evaluate(copy_config, str(tmp_path / 'copied_run'))
  assert copy_final['eval_loss'] == final['eval_loss']
  assert not (copied / 'downloads').exists()
